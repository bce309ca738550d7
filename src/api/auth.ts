import { createHash, timingSafeEqual } from 'node:crypto';
import type { FastifyRequest } from 'fastify';
import type { ApiRole } from '../config/index.js';
import { ProblemError } from './problems.js';

const digest = (token: string) => createHash('sha256').update(token, 'utf8').digest();

/**
 * Checks bearer tokens against the configured ones. Tokens are compared as SHA-256 digests with
 * `timingSafeEqual` (equal lengths by construction), against every configured token without
 * stopping at a match, so the time taken says nothing about how much of a token was right.
 * Tokens are never logged nor put into an error.
 */
export class TokenVerifier {
  private readonly entries: readonly { digest: Buffer; role: ApiRole }[];

  constructor(tokens: ReadonlyMap<string, ApiRole>) {
    this.entries = [...tokens].map(([token, role]) => ({ digest: digest(token), role }));
  }

  /** True when no token is configured: the API is open (and the node binds loopback only). */
  get open(): boolean {
    return this.entries.length === 0;
  }

  /**
   * A stable, non-secret name of the request's valid token (its digest's start), for counting
   * requests per token; null without a valid token.
   */
  callerKey(request: FastifyRequest): string | null {
    const match = /^Bearer[ \t]+(\S+)[ \t]*$/i.exec(request.headers.authorization ?? '');
    if (!match || this.roleOf(request.headers.authorization) === null) return null;
    return `token:${digest(match[1]!).subarray(0, 12).toString('hex')}`;
  }

  /** The role of the request's `Authorization: Bearer <token>`; null when absent or unknown. */
  roleOf(authorization: string | undefined): ApiRole | null {
    const match = /^Bearer[ \t]+(\S+)[ \t]*$/i.exec(authorization ?? '');
    if (!match) return null;
    const presented = digest(match[1]!);
    let role: ApiRole | null = null;
    for (const entry of this.entries) {
      if (timingSafeEqual(presented, entry.digest)) role = entry.role;
    }
    return role;
  }

  /**
   * Throws a 401 problem without a valid token, a 403 one when a viewer asks for a write.
   * Reads (GET, HEAD) need any role; everything else needs admin. Returns the caller's role
   * (admin when the API is open).
   */
  authorize(request: FastifyRequest, need: ApiRole = isRead(request.method) ? 'viewer' : 'admin'): ApiRole {
    if (this.open) return 'admin';
    const role = this.roleOf(request.headers.authorization);
    if (role === null) {
      throw new ProblemError(
        401,
        'unauthorized',
        'Unauthorized',
        'a valid bearer token is required',
        undefined,
        { 'www-authenticate': 'Bearer realm="helios"' },
      );
    }
    if (need === 'admin' && role !== 'admin') {
      throw new ProblemError(403, 'forbidden', 'Forbidden', 'this token may only read (role viewer)');
    }
    return role;
  }
}

const isRead = (method: string) => method === 'GET' || method === 'HEAD';
