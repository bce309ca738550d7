/**
 * `--env K=V` arguments as an environment: split at the first `=` only, so a value may hold one
 * (`--env NODE_OPTIONS=--max-semi-space-size=4`).
 */
export function envArgs(pairs: readonly string[] | undefined): Record<string, string> {
  const env: Record<string, string> = {};
  for (const pair of pairs ?? []) {
    const at = pair.indexOf('=');
    if (at <= 0) throw new Error(`--env wants NAME=VALUE, got ${JSON.stringify(pair)}`);
    env[pair.slice(0, at)] = pair.slice(at + 1);
  }
  return env;
}
