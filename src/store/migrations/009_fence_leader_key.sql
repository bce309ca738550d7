-- Which etcd cluster and leader key the fence's token is a create_revision in, written by every
-- leader write with the token ("<cluster id>/<key>"). A worker reads that leader key to learn
-- which epochs have ended (runs.ts misfiredAtClaim, EndedEpochs); a reading from another etcd or
-- another key (a wrong HELIOS_ETCD_ENDPOINTS or HELIOS_ETCD_PREFIX) has tokens unrelated to the
-- fence's and must not count: it counts only when it names the same cluster and key. NULL (before
-- any leader wrote since this migration, or after a fence reset): no reading counts.
ALTER TABLE leader_fence ADD COLUMN leader_key text;
