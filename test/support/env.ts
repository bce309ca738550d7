import { existsSync, readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

export const REPO_ROOT = fileURLToPath(new URL('../../', import.meta.url));

/** The real servers' addresses, from the environment or from `.helios/env` written by infra.sh up. */
export interface ServerEnv {
  readonly databaseUrl: string;
  readonly etcdEndpoints: string;
  readonly kafkaBrokers: string;
  readonly infraScript: string;
}

let cached: ServerEnv | undefined;

export function serverEnv(): ServerEnv {
  if (cached) return cached;
  const file = `${REPO_ROOT}.helios/env`;
  const fromFile: Record<string, string> = {};
  if (existsSync(file)) {
    for (const line of readFileSync(file, 'utf8').split('\n')) {
      const match = /^export (\w+)=(.*)$/.exec(line.trim());
      if (match) fromFile[match[1]!] = match[2]!;
    }
  }
  const get = (name: string) => {
    const value = process.env[name] ?? fromFile[name];
    if (!value)
      throw new Error(`${name} is not set: run "scripts/infra.sh up" first (it writes .helios/env)`);
    return value;
  };
  cached = {
    databaseUrl: get('HELIOS_DATABASE_URL'),
    etcdEndpoints: get('HELIOS_ETCD_ENDPOINTS'),
    kafkaBrokers: get('HELIOS_KAFKA_BROKERS'),
    infraScript: `${REPO_ROOT}scripts/infra.sh`,
  };
  return cached;
}

/** A short random id for names that must not collide between test files and runs. */
export function uniqueId(): string {
  return `${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
}
