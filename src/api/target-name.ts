import type { FastifyRequest } from 'fastify';
import { toError } from '../errors.js';
import { withTimeout } from '../errors.js';
import {
  assertTargetAllowed,
  checkTargetUrl,
  TargetDeniedError,
  type TargetPolicy,
} from '../security/target-policy.js';
import { badRequest } from './problems.js';

/** How long a save waits for DNS; a name that does not answer in time is checked at execution. */
const LOOKUP_TIMEOUT_MS = 2000;

/**
 * The save-time half of the target policy for names: when a job's `target.url` (POST /jobs,
 * PATCH /jobs/{id}) names a host that resolves into a denied range or to one of the cluster's own
 * endpoints, a 400 naming `target.url`. A name that does not resolve is accepted (DNS may not be
 * set up yet); the worker checks every connection's address anyway. URL literals and shapes are
 * checked by compileJob.
 */
export async function checkTargetName(request: FastifyRequest, policy: TargetPolicy): Promise<void> {
  if (request.method !== 'POST' && request.method !== 'PATCH') return;
  const url = (request.body as { target?: { url?: unknown } } | null | undefined)?.target?.url;
  // A URL the policy refuses as written is compileJob's to report, with the job's other problems.
  if (typeof url !== 'string' || !URL.canParse(url) || checkTargetUrl(url, policy) !== null) return;
  try {
    await withTimeout(assertTargetAllowed(url, policy), LOOKUP_TIMEOUT_MS, 'resolving target.url');
  } catch (err) {
    const error = toError(err);
    if (error instanceof TargetDeniedError && error.permanent) {
      throw badRequest([{ field: 'target.url', message: error.reason }]);
    }
  }
}
