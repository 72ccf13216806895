//! Constrained decoding: a grammar the output must match (a JSON Schema,
//! any JSON object, a regular expression or a Lark grammar), compiled by
//! llguidance against the model's vocabulary, and per sequence a matcher
//! that says which tokens may come next.
//!
//! A grammar is compiled on the request's own thread (`EngineHandle::generate`),
//! never on the engine thread, and bounded by llguidance's limits (grammar
//! size, lexer states, work per token), so a hostile schema is a 400, not a
//! stalled model. On the engine thread each constrained sequence computes its
//! own mask right before its token is sampled (tens of microseconds for
//! JSON); unconstrained sequences in the same batch do nothing extra.
//! Logprobs of a constrained sequence are those of the constrained
//! distribution: disallowed tokens have probability 0.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use tokenizers::Tokenizer;

use super::api::Grammar;
use crate::util::panic_message;

/// Caps on what one grammar may cost. llguidance's defaults, with the
/// grammar size lowered: a JSON Schema in a request body is at most a few
/// hundred kilobytes, and compiling one must take milliseconds, not seconds.
fn limits() -> ParserLimits {
    ParserLimits {
        max_grammar_size: 200_000,
        ..ParserLimits::default()
    }
}

/// The model's vocabulary as llguidance sees it, and the factory that
/// compiles grammars against it. Built once per model, on the first
/// constrained request (a trie over the vocabulary: tens of milliseconds).
pub struct Grammars {
    factory: ParserFactory,
}

/// The vocabulary's bytes (as a trie) and the tokenizer, for llguidance.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// How the model spells a grammar's literal text (forced prefixes).
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        let text = String::from_utf8_lossy(s);
        self.tokenizer
            .encode(text.as_ref(), false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }
}

impl Grammars {
    /// `rows` is the width of the model's logits, which may exceed the
    /// tokenizer's vocabulary (padded embeddings): ids past it are never
    /// allowed. `eos` are the ids that end generation; a grammar allows
    /// them once its output is complete.
    pub fn new(tokenizer: &Tokenizer, eos: &[u32], rows: usize) -> Result<Grammars, String> {
        let json = serde_json::to_value(tokenizer)
            .map_err(|e| format!("cannot read the tokenizer for constrained decoding: {e}"))?;
        // The library asserts on vocabularies it does not expect.
        let mut words = std::panic::catch_unwind(AssertUnwindSafe(|| {
            llguidance::token_bytes_from_tokenizer_json(&json)
        }))
        .map_err(|p| panic_message(&*p))
        .and_then(|r| r.map_err(|e| e.to_string()))
        .map_err(|e| {
            format!("this model's tokenizer cannot be used for constrained decoding: {e}")
        })?;
        if words.len() > rows {
            return Err(format!(
                "the tokenizer has {} tokens but the model only {rows} logits",
                words.len()
            ));
        }
        // Ids without text (padding rows, holes) get a special name that no
        // grammar can produce: the marker byte, then `<[id]>`.
        words.resize(rows, Vec::new());
        for (id, w) in words.iter_mut().enumerate() {
            if w.is_empty() {
                w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                w.extend_from_slice(format!("<[{id}]>").as_bytes());
            }
        }
        let first_eos = *eos
            .first()
            .ok_or("the model has no end-of-sequence token, so no grammar could end")?;
        let info = TokRxInfo::new(rows as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(Vocabulary {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let caps = InferenceCapabilities::default();
        let mut factory = ParserFactory::new(
            &env,
            caps,
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| e.to_string())?;
        *factory.limits_mut() = limits();
        factory.set_stderr_log_level(0);
        Ok(Grammars { factory })
    }

    /// Compiles `grammar` for one sequence; the error says what in it
    /// cannot be compiled (unsupported schema keywords, a bad regex, a
    /// grammar over the limits).
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, String> {
        let top = match grammar {
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(json_options(schema)),
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(json_options(&json!({"type": "object"})))
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Lark(lark) | Grammar::ToolCalls(lark) => {
                TopLevelGrammar::from_lark(lark.clone())
            }
        };
        let parser = std::panic::catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(top)))
            .map_err(|p| format!("the grammar compiler failed: {}", panic_message(&*p)))?
            .map_err(|e| e.to_string())?;
        Ok(Constraint {
            matcher: Box::new(Matcher::new(Ok(parser))),
        })
    }
}

/// `schema` with mlxgate's JSON layout unless it sets its own
/// (llguidance's `x-guidance` key): Python's `json.dumps` layout, `", "`
/// and `": "` and no other whitespace. A fixed layout is what tool-call
/// arguments and hosted structured outputs give, and it keeps a small
/// model that prefers whitespace from spending its whole token budget on
/// newlines between keys and leaving the JSON unfinished.
pub(crate) fn json_options(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
    {
        map.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// One sequence's grammar state (boxed: a matcher is over a kilobyte, and
/// jobs travel by value through the engine's queue).
pub struct Constraint {
    matcher: Box<Matcher>,
}

impl Constraint {
    /// Sets every token the grammar does not allow next to -inf in `logits`.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| format!("constrained decoding failed: {e}"))?;
        let words = allowed.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, logit) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    /// The same grammar state for another choice of the same prompt.
    pub fn fork(&self) -> Constraint {
        Constraint {
            matcher: Box::new(self.matcher.deep_clone()),
        }
    }

    /// Moves the grammar past the sampled `token`.
    pub fn advance(&mut self, token: u32) -> Result<(), String> {
        self.matcher
            .consume_token(token)
            .map_err(|e| format!("constrained decoding failed: {e}"))
    }
}
