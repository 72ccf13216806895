//! Training data: JSONL records (chat `messages`, `prompt`/`completion`,
//! `text`) tokenized into examples whose prompt part the loss can skip, and
//! examples grouped by length into padded batches as MLX inputs.

use std::path::Path;

use mlx_rs::Array;
use serde_json::Value;

use super::{TrainError, TrainSettings};
use crate::engine::api::ChatMessage;
use crate::engine::text::TextCodec;

/// One tokenized example: the loss counts `tokens[prompt_len..]` as targets.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
}

/// Reads a JSONL file: one JSON object per non-empty line.
pub fn read_jsonl(path: &Path) -> Result<Vec<Value>, TrainError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| TrainError::Data(format!("cannot read {}: {e}", path.display())))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).map_err(|e| {
            TrainError::Data(format!("{} line {}: not JSON: {e}", path.display(), i + 1))
        })?;
        if !v.is_object() {
            return Err(TrainError::Data(format!(
                "{} line {}: not a JSON object",
                path.display(),
                i + 1
            )));
        }
        out.push(v);
    }
    Ok(out)
}

fn text_field<'a>(record: &'a Value, key: &str) -> Result<&'a str, String> {
    record
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("`{key}` must be a string"))
}

/// Tokenizes one record (`messages`, `prompt`/`completion` or `text`).
pub fn encode_record(
    codec: &TextCodec,
    record: &Value,
    mask_prompt: bool,
) -> Result<Example, String> {
    let (tokens, prompt_len) = if let Some(messages) = record.get("messages") {
        let list = messages
            .as_array()
            .ok_or("`messages` must be an array of {role, content}")?;
        let mut chat = Vec::with_capacity(list.len());
        for m in list {
            chat.push(ChatMessage::text(
                text_field(m, "role")?,
                text_field(m, "content")?,
            ));
        }
        if chat.is_empty() {
            return Err("`messages` is empty".into());
        }
        chat_example(codec, &chat)?
    } else if let Some(prompt) = record.get("prompt") {
        let prompt = prompt.as_str().ok_or("`prompt` must be a string")?;
        let completion = text_field(record, "completion")?;
        let chat = [
            ChatMessage::text("user", prompt),
            ChatMessage::text("assistant", completion),
        ];
        match chat_example(codec, &chat) {
            Ok(pair) => pair,
            Err(_) => {
                // No chat template: the plain text of both.
                let p = codec.encode(prompt)?;
                let mut all = codec.encode(&format!("{prompt}{completion}"))?;
                push_eos(codec, &mut all);
                let shared = p.iter().zip(&all).take_while(|(a, b)| a == b).count();
                (all, shared)
            }
        }
    } else if record.get("text").is_some() {
        let mut all = codec.encode(text_field(record, "text")?)?;
        push_eos(codec, &mut all);
        (all, 0)
    } else {
        return Err("a record needs `messages`, `prompt` and `completion`, or `text`".into());
    };
    if tokens.len() < 2 {
        return Err("the record has fewer than two tokens".into());
    }
    Ok(Example {
        prompt_len: if mask_prompt {
            prompt_len.min(tokens.len() - 1)
        } else {
            0
        },
        tokens,
    })
}

fn push_eos(codec: &TextCodec, tokens: &mut Vec<u32>) {
    if let Some(&eos) = codec.eos_ids.first()
        && tokens.last() != Some(&eos)
    {
        tokens.push(eos);
    }
}

/// The whole conversation and the length of its part before the last
/// assistant turn (with that turn's opening), as mlx-lm's `ChatDataset`.
fn chat_example(codec: &TextCodec, chat: &[ChatMessage]) -> Result<(Vec<u32>, usize), String> {
    let full = codec.encode(&codec.render_chat_with(chat, false)?)?;
    let last_is_assistant = chat.last().is_some_and(|m| m.role == "assistant");
    let prompt_len = if last_is_assistant {
        let prompt = codec.encode(&codec.render_chat_with(&chat[..chat.len() - 1], true)?)?;
        prompt.iter().zip(&full).take_while(|(a, b)| a == b).count()
    } else {
        0
    };
    Ok((full, prompt_len))
}

/// A tokenized split and what was dropped or cut while reading it.
#[derive(Debug, Default)]
pub struct Split {
    pub examples: Vec<Example>,
    /// Examples longer than `max_seq_len`, cut to it.
    pub truncated: usize,
}

/// Reads and tokenizes `path` (JSONL). A record that cannot be read is an
/// error naming its line.
pub fn load_split(
    path: &Path,
    codec: &TextCodec,
    settings: &TrainSettings,
) -> Result<Split, TrainError> {
    let mut split = Split::default();
    for (i, record) in read_jsonl(path)?.iter().enumerate() {
        let mut ex = encode_record(codec, record, settings.mask_prompt)
            .map_err(|e| TrainError::Data(format!("{} record {}: {e}", path.display(), i + 1)))?;
        if ex.tokens.len() > settings.max_seq_len {
            ex.tokens.truncate(settings.max_seq_len.max(2));
            split.truncated += 1;
        }
        if ex.prompt_len >= ex.tokens.len() - 1 && settings.mask_prompt {
            // Nothing left to learn from after the cut.
            continue;
        }
        split.examples.push(ex);
    }
    if split.examples.is_empty() {
        return Err(TrainError::Data(format!(
            "{} has no usable examples",
            path.display()
        )));
    }
    Ok(split)
}

/// Batches of example indices, sorted by length so padding stays small.
pub(super) fn make_batches(examples: &[Example], batch_size: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..examples.len()).collect();
    order.sort_by_key(|&i| (examples[i].tokens.len(), i));
    order
        .chunks(batch_size.max(1))
        .map(<[usize]>::to_vec)
        .collect()
}

/// One padded batch as MLX inputs: token ids `[B, L-1]`, and the flat
/// positions (into `B * (L-1)`) and labels of the counted targets.
pub(super) struct Batch {
    pub(super) inputs: Array,
    pub(super) positions: Array,
    pub(super) labels: Array,
    /// Counted target tokens.
    pub(super) targets: usize,
    /// Non-padding input tokens.
    pub(super) tokens: usize,
}

pub(super) fn build_batch(examples: &[&Example]) -> Batch {
    let width = examples.iter().map(|e| e.tokens.len()).max().unwrap_or(2) - 1;
    let mut inputs = Vec::with_capacity(examples.len() * width);
    let (mut positions, mut labels) = (Vec::new(), Vec::new());
    let mut tokens = 0;
    for (b, e) in examples.iter().enumerate() {
        let n = e.tokens.len() - 1;
        tokens += n;
        inputs.extend_from_slice(&e.tokens[..n]);
        inputs.extend(std::iter::repeat_n(0u32, width - n));
        // Target t (predicting tokens[t + 1]) counts when t + 1 >= prompt_len.
        for t in e.prompt_len.saturating_sub(1)..n {
            positions.push((b * width + t) as u32);
            labels.push(e.tokens[t + 1]);
        }
    }
    let targets = labels.len();
    Batch {
        inputs: Array::from_slice(&inputs, &[examples.len() as i32, width as i32]),
        positions: Array::from_slice(&positions, &[targets as i32]),
        labels: Array::from_slice(&labels, &[targets as i32, 1]),
        targets,
        tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_count_only_completion_targets() {
        let a = Example {
            tokens: vec![1, 2, 3, 4, 5],
            prompt_len: 3,
        };
        let b = Example {
            tokens: vec![7, 8, 9],
            prompt_len: 0,
        };
        let batch = build_batch(&[&a, &b]);
        assert_eq!(batch.inputs.shape(), &[2, 4]);
        // a: targets 4, 5 at positions 2, 3; b: 8, 9 at 4 + 0, 4 + 1.
        assert_eq!(batch.positions.as_slice::<u32>(), &[2, 3, 4, 5]);
        assert_eq!(batch.labels.as_slice::<u32>(), &[4, 5, 8, 9]);
        assert_eq!((batch.targets, batch.tokens), (4, 6));
    }
}
