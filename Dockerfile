# syntax=docker/dockerfile:1
# The Helios node image: `docker build -t helios .` then `docker run helios node` (or `migrate`,
# `fence status`, `jobs list`, ...: the entrypoint is the `helios` CLI). Configured only by HELIOS_*
# variables (README, Configuration). Node.js 24.21.0: the `node` devDependency that `npm test` runs
# on, not a floating tag; test/unit/deploy-files.test.ts checks the two stay the same.
ARG NODE_IMAGE=node:24.21.0-bookworm-slim

# ---- build: every dependency, compile TypeScript to dist/ ---------------------------------------
FROM ${NODE_IMAGE} AS build
WORKDIR /src
COPY package.json package-lock.json ./
# --ignore-scripts: the only install scripts are the `node` devDependency's (it fetches a second
# Node.js binary, which the image already has), esbuild's (tsx; not needed to compile) and
# protobufjs' (a version notice). Nothing here needs them.
RUN npm ci --ignore-scripts --no-audit --no-fund
COPY tsconfig.json tsconfig.build.json ./
COPY scripts/copy-sql.mjs scripts/copy-sql.mjs
COPY src src
# tsc is called through the image's node, not through `npm run build`: npm would put
# node_modules/.bin first on the PATH, where the `node` devDependency's unfetched binary sits.
RUN node node_modules/typescript/bin/tsc -p tsconfig.build.json && node scripts/copy-sql.mjs

# ---- deps: production dependencies only ---------------------------------------------------------
FROM ${NODE_IMAGE} AS deps
WORKDIR /app
COPY package.json package-lock.json ./
RUN npm ci --omit=dev --ignore-scripts --no-audit --no-fund && npm cache clean --force

# ---- runtime ------------------------------------------------------------------------------------
FROM ${NODE_IMAGE} AS runtime
# A young generation of 8 MB semi-spaces instead of V8's default (up to 16 MB each, grown to the
# limit by a leader's dispatch): ≈20–40 MB less resident per node, at the same CPU per run in a
# warm herd as 16 MB; 4 MB cost ≈15 % more CPU per run there (README, Performance). Override
# NODE_OPTIONS to change it; scripts/cluster.sh and the benchmarks use this same line.
ENV NODE_ENV=production \
    NODE_OPTIONS=--max-semi-space-size=8 \
    HELIOS_HTTP_HOST=0.0.0.0 \
    HELIOS_HTTP_PORT=8080
WORKDIR /app
COPY --from=deps --chown=root:root /app/node_modules node_modules
COPY --from=build --chown=root:root /src/dist dist
COPY --chown=root:root package.json ./
# The code is owned by root and read-only to the process; it runs as the image's unprivileged
# `node` user (uid 1000), which owns nothing it could rewrite.
RUN chmod 0755 dist/main.js && ln -s /app/dist/main.js /usr/local/bin/helios
USER node
EXPOSE 8080
# /readyz answers 503 only when PostgreSQL does not answer (200 "degraded" without etcd or Kafka,
# see README, Operations); node's own fetch, since the slim image has no curl.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["node", "-e", "fetch('http://127.0.0.1:'+(process.env.HELIOS_HTTP_PORT||8080)+'/readyz').then(r=>process.exit(r.ok?0:1),()=>process.exit(1))"]
# SIGTERM drains in-flight runs within HELIOS_SHUTDOWN_TIMEOUT_MS (node is PID 1 here: main.ts
# handles SIGTERM and SIGINT itself, so no init shim is needed for the signals).
STOPSIGNAL SIGTERM
ENTRYPOINT ["helios"]
CMD ["node"]
