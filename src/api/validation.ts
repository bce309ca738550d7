import type { Static, TSchema } from 'typebox';
import { Compile } from 'typebox/compile';
import type { TLocalizedValidationError } from 'typebox/error';
import { Settings } from 'typebox/system';
import type { FastifySchemaCompiler, FastifySchemaValidationError } from 'fastify';
import { badRequest, fieldOf, type FieldError } from './problems.js';

/** At most this many problems are reported per request (a huge bad body must not cost much). */
const MAX_ERRORS = 20;

// TypeBox stops collecting errors after `maxErrors` (8 by default), and a failed union reports one
// error per branch before its own: a bad `target.method` (7 literals) alone is 14 branch errors, so
// with 8 the union's own error, the one that names the field in plain words, was never reached.
// Still a bound: a huge bad body costs at most this many errors.
Settings.Set({ maxErrors: 64 });

/** One problem for one field: where it is (a JSON pointer) and what is wrong, in plain words. */
interface Issue {
  readonly keyword: string;
  readonly instancePath: string;
  readonly schemaPath: string;
  readonly message: string;
}

/** The part of `schema` a TypeBox schema path (`#/properties/kind`) points at. */
function schemaAt(schema: unknown, schemaPath: string): unknown {
  let node = schema;
  for (const segment of schemaPath.split('/').slice(1)) {
    if (typeof node !== 'object' || node === null) return undefined;
    node = (node as Record<string, unknown>)[segment.replaceAll('~1', '/').replaceAll('~0', '~')];
  }
  return node;
}

const escapePointer = (name: string) => name.replaceAll('~', '~0').replaceAll('/', '~1');

/**
 * TypeBox 1.x reports errors the way Ajv does: a missing or unknown property on its parent object
 * (params name the properties), and a failed union both as its own error and as one error per
 * branch tried. The API names the failing field and says it plainly, so: one issue per missing or
 * unknown property at that property's path, the union's own error only (with its allowed values
 * when they are string literals), and TypeBox's message otherwise.
 */
function* issuesOf(schema: TSchema, errors: Iterable<TLocalizedValidationError>): Generator<Issue> {
  let yielded = false;
  let firstBranch: TLocalizedValidationError | undefined;
  for (const issue of issuesOfErrors(schema, errors, (branch) => (firstBranch ??= branch))) {
    yielded = true;
    yield issue;
  }
  // Only branch errors were collected (the union's own error was past maxErrors): a 400 must still
  // name a field, the nearest one a branch error names.
  if (!yielded && firstBranch) {
    const { keyword, instancePath, schemaPath } = firstBranch;
    yield { keyword, instancePath, schemaPath, message: 'does not match any allowed form' };
  }
}

function* issuesOfErrors(
  schema: TSchema,
  errors: Iterable<TLocalizedValidationError>,
  onBranch: (error: TLocalizedValidationError) => void,
): Generator<Issue> {
  // Unknown properties already reported, by path: each comes twice (see below).
  const unknown = new Set<string>();
  for (const error of errors) {
    const { keyword, instancePath, schemaPath } = error;
    // A branch of a union that did not match: the union's own error says it for the field.
    if (/\/anyOf\/\d+/.test(schemaPath)) {
      onBranch(error);
      continue;
    }
    if (error.keyword === 'required') {
      for (const name of error.params.requiredProperties) {
        yield {
          keyword,
          schemaPath,
          instancePath: `${instancePath}/${escapePointer(name)}`,
          message: 'is required',
        };
      }
    } else if (error.keyword === 'additionalProperties') {
      for (const name of error.params.additionalProperties) {
        const path = `${instancePath}/${escapePointer(name)}`;
        if (unknown.has(path)) continue;
        unknown.add(path);
        yield { keyword, schemaPath, instancePath: path, message: 'is not a known field' };
      }
    } else if (keyword === 'boolean' && schemaPath.endsWith('/additionalProperties')) {
      // An unknown property as `additionalProperties: false` failing for it. TypeBox reports
      // these before the one error listing them all, which 64 of them (maxErrors) keep out: a body
      // or query with that many unknown fields was a 400 naming none.
      if (unknown.has(instancePath)) continue;
      unknown.add(instancePath);
      yield { keyword: 'additionalProperties', schemaPath, instancePath, message: 'is not a known field' };
    } else if (keyword === 'anyOf') {
      const options = (schemaAt(schema, schemaPath) as { anyOf?: { const?: unknown }[] } | undefined)?.anyOf;
      const literals = options?.length && options.every((o) => typeof o.const === 'string');
      const message = literals
        ? `must be one of ${options.map((o) => String(o.const)).join(', ')}`
        : error.message;
      yield { keyword, schemaPath, instancePath, message };
    } else {
      yield { keyword, schemaPath, instancePath, message: error.message };
    }
  }
}

/** How an integer is written in a query string or path: decimal digits. */
const DECIMAL_INTEGER = /^[+-]?\d+$/;

/**
 * `input` (a query string's or path's strings) converted to `schema`'s types, except integers not
 * written as decimal digits, left as the string they were so the check fails naming them: TypeBox's
 * Convert reads 1.5 as 1, `true` as 1 and 0x10 as 16, and `?limit=1.5` was a page of 1.
 */
function convertStrings(schema: TSchema, validator: ReturnType<typeof Compile>, input: unknown): unknown {
  if (typeof input !== 'object' || input === null) return validator.Convert(input);
  const raw = Object.entries(input);
  const value = validator.Convert(input);
  if (typeof value !== 'object' || value === null) return value;
  const properties = (schema as { properties?: Record<string, { type?: unknown }> }).properties ?? {};
  for (const [name, text] of raw) {
    if (properties[name]?.type === 'integer' && typeof text === 'string' && !DECIMAL_INTEGER.test(text)) {
      (value as Record<string, unknown>)[name] = text;
    }
  }
  return value;
}

/**
 * Validates requests with TypeBox's compiler instead of Fastify's default Ajv setup, which
 * silently drops unknown properties and coerces body types ("5" → 5). Bodies are checked as
 * sent; query strings and path parameters are converted from strings first (integers only from
 * decimal digits).
 */
export const validatorCompiler: FastifySchemaCompiler<TSchema> = ({ schema, httpPart }) => {
  const validator = Compile(schema);
  return (input: unknown) => {
    const value = httpPart === 'body' ? input : convertStrings(schema, validator, input);
    if (validator.Check(value)) return { value };
    const error: FastifySchemaValidationError[] = [];
    for (const issue of issuesOf(schema, validator.Errors(value))) {
      error.push({ ...issue, params: {} });
      if (error.length >= MAX_ERRORS) break;
    }
    return { error };
  };
};

/** Compiled once per schema: the programmatic API checks the same few schemas over and over. */
const compiled = new WeakMap<TSchema, ReturnType<typeof Compile>>();

/**
 * Checks a value against a schema outside a request (the programmatic API), with the same
 * messages as the routes. @throws ProblemError 400 naming the failing fields.
 */
export function checkInput<T extends TSchema>(schema: T, value: unknown): Static<T> {
  let validator = compiled.get(schema);
  if (!validator) compiled.set(schema, (validator = Compile(schema)));
  if (validator.Check(value)) return value as Static<T>;
  const errors: FieldError[] = [];
  for (const issue of issuesOf(schema, validator.Errors(value))) {
    errors.push({ field: fieldOf(issue.instancePath, 'body'), message: issue.message });
    if (errors.length >= MAX_ERRORS) break;
  }
  throw badRequest(errors);
}
