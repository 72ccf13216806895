//! Response bodies in OpenAI's shapes: `chat.completion`,
//! `chat.completion.chunk` and `text_completion` (whole and streamed).

use std::collections::BTreeMap;

use serde::Serialize;

use super::engine::{self, TokenOutput};
use super::tools::CallOut;

/// OpenAI's `usage`.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's `usage.prompt_tokens_details`: how much of the prompt a
/// prompt cache served.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl From<engine::Usage> for Usage {
    fn from(u: engine::Usage) -> Self {
        Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

// ---------------------------------------------------------------- chat

#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    pub system_fingerprint: String,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// `null` when the answer is only tool calls.
    pub content: Option<String>,
    pub refusal: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<CallOut>,
}

/// `{"content": [...]}` of a chat choice.
#[derive(Debug, Default, Serialize, PartialEq)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

impl ChatLogprobs {
    pub fn push(&mut self, tokens: &[TokenOutput]) {
        self.content.extend(tokens.iter().map(|t| {
            TokenLogprob {
                token: t.text.clone(),
                logprob: t.logprob.unwrap_or(0.0),
                bytes: t.text.as_bytes().to_vec(),
                top_logprobs: t
                    .top_logprobs
                    .iter()
                    .map(|(token, logprob)| TopLogprob {
                        token: token.clone(),
                        logprob: *logprob,
                        bytes: token.as_bytes().to_vec(),
                    })
                    .collect(),
            }
        }));
    }

    pub fn of(tokens: &[TokenOutput]) -> Self {
        let mut l = ChatLogprobs::default();
        l.push(tokens);
        l
    }
}

#[derive(Debug, Serialize)]
pub struct ChatChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub system_fingerprint: &'a str,
    pub choices: Vec<ChunkChoice>,
    /// Present (null until the last chunk) only with `include_usage`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<CallOut>,
}

// ---------------------------------------------------------------- completions

#[derive(Debug, Serialize)]
pub struct TextCompletion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub system_fingerprint: &'a str,
    pub choices: Vec<TextChoice>,
    /// Always present in a whole response; with `include_usage` in a stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Serialize)]
pub struct TextChoice {
    pub text: String,
    pub index: usize,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// The legacy completions logprobs: parallel arrays.
#[derive(Debug, Default, Serialize, PartialEq)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
    /// Character offset of each token in the generated text.
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Appends `tokens`; `offset` is the length (in chars) of the text
    /// generated before them, advanced past them on return.
    pub fn push(&mut self, tokens: &[TokenOutput], offset: &mut usize) {
        for t in tokens {
            self.tokens.push(t.text.clone());
            self.token_logprobs.push(t.logprob.unwrap_or(0.0));
            self.top_logprobs
                .push(t.top_logprobs.iter().cloned().collect());
            self.text_offset.push(*offset);
            *offset += t.text.chars().count();
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tok(text: &str, lp: f32) -> TokenOutput {
        TokenOutput {
            id: 1,
            text: text.into(),
            logprob: Some(lp),
            top_logprobs: vec![(text.into(), lp), ("x".into(), -3.0)],
        }
    }

    #[test]
    fn chat_logprobs_shape() {
        let l = ChatLogprobs::of(&[tok("Hi", -0.5)]);
        assert_eq!(
            serde_json::to_value(&l).unwrap(),
            json!({"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                                 {"token": "x", "logprob": -3.0, "bytes": [120]}]}]})
        );
    }

    #[test]
    fn completion_logprobs_offsets() {
        let mut l = CompletionLogprobs::default();
        let mut off = 0;
        l.push(&[tok("é", -1.0), tok("ab", -2.0)], &mut off);
        l.push(&[tok("c", -0.25)], &mut off);
        assert_eq!(off, 4);
        assert_eq!(
            serde_json::to_value(&l).unwrap(),
            json!({"tokens": ["é", "ab", "c"], "token_logprobs": [-1.0, -2.0, -0.25],
                   "top_logprobs": [{"é": -1.0, "x": -3.0}, {"ab": -2.0, "x": -3.0}, {"c": -0.25, "x": -3.0}],
                   "text_offset": [0, 1, 3]})
        );
    }

    #[test]
    fn usage_totals() {
        let u = Usage::from(engine::Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
            cached_tokens: 2,
        });
        assert_eq!(u.total_tokens, 7);
        assert_eq!(u.prompt_tokens_details.cached_tokens, 2);
    }
}
