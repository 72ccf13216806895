// Alpaca to chat, in JavaScript: the same policy as policies/alpaca-to-chat.
//
// {"instruction", "input", "output"} records become
// {"messages": [{"role": "system"?}, {"role": "user"}, {"role": "assistant"}]};
// the user turn is the instruction, then a blank line and the input when
// there is one. Config {"system": "..."} adds a system turn. Records without
// an instruction or an output, and malformed JSON, are errors.

import { error, keep } from './mlxgate-policy.js';

let system = null;

function one(text) {
  let rec;
  try {
    rec = JSON.parse(text);
  } catch (e) {
    return error(`invalid JSON: ${e.message}`);
  }
  if (rec === null || typeof rec !== 'object' || Array.isArray(rec)) {
    return error('invalid JSON: not an object');
  }
  const instruction = rec.instruction;
  if (typeof instruction !== 'string' || !instruction.trim()) return error('missing `instruction`');
  if (rec.output === undefined || rec.output === null) return error('missing `output`');
  const input = (rec.input ?? '').trim();
  const messages = system ? [{ role: 'system', content: system }] : [];
  messages.push({ role: 'user', content: input ? `${instruction}\n\n${input}` : instruction });
  messages.push({ role: 'assistant', content: rec.output });
  return keep({ messages });
}

export const datasetTransform = {
  init(config) {
    system = config.trim() ? (JSON.parse(config).system ?? null) : null;
  },
  transform(records) {
    return records.map(one);
  },
};
