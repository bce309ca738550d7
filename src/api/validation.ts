import type { Static, TSchema } from '@sinclair/typebox';
import { TypeCompiler, ValueErrorType, type ValueError } from '@sinclair/typebox/compiler';
import { Value } from '@sinclair/typebox/value';
import type { FastifySchemaCompiler, FastifySchemaValidationError } from 'fastify';
import { badRequest, fieldOf, type FieldError } from './problems.js';

/** At most this many problems are reported per request (a huge bad body must not cost much). */
const MAX_ERRORS = 20;

/** Plainer words than TypeBox's for the common cases ("Expected union value" says little). */
function messageOf(issue: ValueError): string {
  if (issue.type === ValueErrorType.ObjectRequiredProperty) return 'is required';
  if (issue.type === ValueErrorType.ObjectAdditionalProperties) return 'is not a known field';
  const options = (issue.schema as { anyOf?: { const?: unknown }[] }).anyOf;
  if (options?.length && options.every((o) => typeof o.const === 'string')) {
    return `must be one of ${options.map((o) => String(o.const)).join(', ')}`;
  }
  return issue.message;
}

/**
 * Validates requests with TypeBox's compiler instead of Fastify's default Ajv setup, which
 * silently drops unknown properties and coerces body types ("5" → 5). Bodies are checked as
 * sent; query strings and path parameters are converted from strings first.
 */
export const validatorCompiler: FastifySchemaCompiler<TSchema> = ({ schema, httpPart }) => {
  const check = TypeCompiler.Compile(schema);
  return (input: unknown) => {
    const value = httpPart === 'body' ? input : Value.Convert(schema, input);
    if (check.Check(value)) return { value };
    const error: FastifySchemaValidationError[] = [];
    for (const issue of check.Errors(value)) {
      error.push({
        keyword: String(issue.type),
        instancePath: issue.path,
        schemaPath: '',
        params: {},
        message: messageOf(issue),
      });
      if (error.length >= MAX_ERRORS) break;
    }
    return { error };
  };
};

/**
 * Checks a value against a schema outside a request (the programmatic API), with the same
 * messages as the routes. @throws ProblemError 400 naming the failing fields.
 */
const compiled = new WeakMap<TSchema, ReturnType<typeof TypeCompiler.Compile>>();

export function checkInput<T extends TSchema>(schema: T, value: unknown): Static<T> {
  let check = compiled.get(schema);
  if (!check) compiled.set(schema, (check = TypeCompiler.Compile(schema)));
  if (check.Check(value)) return value;
  const errors: FieldError[] = [];
  for (const issue of check.Errors(value)) {
    errors.push({ field: fieldOf(issue.path, 'body'), message: messageOf(issue) });
    if (errors.length >= MAX_ERRORS) break;
  }
  throw badRequest(errors);
}
