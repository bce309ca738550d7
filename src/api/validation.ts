import type { TSchema } from '@sinclair/typebox';
import { TypeCompiler, ValueErrorType, type ValueError } from '@sinclair/typebox/compiler';
import { Value } from '@sinclair/typebox/value';
import type { FastifySchemaCompiler, FastifySchemaValidationError } from 'fastify';

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
