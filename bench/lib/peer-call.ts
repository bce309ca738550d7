import type { Agent } from 'undici';

const BODY = JSON.stringify({ bench: true });

/**
 * The HTTP call the peers' handlers make (bench/peers/herd-worker.ts), the one a Helios worker
 * makes for a bench job (http-executor.ts prepare()): same method, path, headers and body,
 * through a bare undici Agent, the response read to its end. Returns the status code.
 * bench/http-cpu.ts --plain measures its CPU against the executor's.
 */
export async function peerCall(
  agent: Agent,
  origin: string,
  id: string,
  scheduledFor: string,
): Promise<number> {
  const response = await agent.request({
    origin,
    path: '/tick',
    method: 'POST',
    headers: {
      'content-type': 'application/json',
      'idempotency-key': id,
      'x-helios-job-id': id,
      'x-helios-run-id': id,
      'x-helios-scheduled-for': scheduledFor,
      'x-helios-attempt': '1',
    },
    body: BODY,
  });
  await response.body.text();
  return response.statusCode;
}
