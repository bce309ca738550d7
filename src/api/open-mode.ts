import type { FastifyRequest } from 'fastify';
import { isLoopbackHost } from '../config/index.js';
import { ProblemError } from './problems.js';

// Without tokens the API trusts whoever reaches it, and it binds loopback only. Two ways around
// that go through the operator's own browser: DNS rebinding (a page whose name now resolves to
// 127.0.0.1 talks to the API as a same-origin page, with a foreign Host header) and cross-site
// "simple" requests (a form post or a bodiless fetch needs no CORS preflight and still has its
// effect, even if the page cannot read the answer). These checks close both.

/** The header a client sends on a write in open mode; a simple cross-site request cannot set it. */
export const CLIENT_HEADER = 'x-helios-client';

const SAFE_METHODS = new Set(['GET', 'HEAD', 'OPTIONS']);

const forbidden = (detail: string) => new ProblemError(403, 'forbidden', 'Forbidden', detail);

/** The host part of a Host header (`127.0.0.1:8080`, `[::1]:8080`, `localhost`). */
function hostOf(header: string): string {
  const bracketed = /^\[([^\]]+)\](?::\d+)?$/.exec(header);
  if (bracketed) return bracketed[1]!;
  return header.replace(/:\d+$/, '');
}

const isJson = (contentType: string | undefined) =>
  /^application\/json\s*(;|$)/i.test((contentType ?? '').trim());

/**
 * Throws a 403 problem unless the request may reach an open (token-less) API: its Host is a
 * loopback name or address, its Origin (when sent) is the API's own, a browser does not mark it
 * cross-site, and a write carries `content-type: application/json` or {@link CLIENT_HEADER}.
 */
export function checkOpenModeRequest(request: FastifyRequest): void {
  const host = request.headers.host ?? '';
  if (!host || !isLoopbackHost(hostOf(host))) {
    throw forbidden('without HELIOS_API_TOKENS only a loopback Host (127.0.0.1, [::1], localhost) is served');
  }
  const origin = request.headers.origin;
  if (origin !== undefined) {
    const own = [`http://${host}`, `https://${host}`];
    if (!own.includes(origin.toLowerCase())) {
      throw forbidden('cross-origin requests are refused without HELIOS_API_TOKENS');
    }
  }
  const site = request.headers['sec-fetch-site'];
  if (site !== undefined && site !== 'same-origin' && site !== 'none') {
    throw forbidden('cross-site requests are refused without HELIOS_API_TOKENS');
  }
  if (SAFE_METHODS.has(request.method)) return;
  if (isJson(request.headers['content-type']) || request.headers[CLIENT_HEADER] !== undefined) return;
  throw forbidden(
    `a write needs content-type application/json or an ${CLIENT_HEADER} header without HELIOS_API_TOKENS`,
  );
}
