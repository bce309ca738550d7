// Copies the numbered migration files next to the compiled store so dist/ is self-contained.
import { cpSync, mkdirSync } from 'node:fs';
mkdirSync('dist/store/migrations', { recursive: true });
cpSync('src/store/migrations', 'dist/store/migrations', { recursive: true });
