//! A sentence-embedding model as sentence-transformers lays it out: the
//! encoder, its tokenizer, `sentence_bert_config.json` (max length),
//! `modules.json` with `1_Pooling/config.json` (pooling) and `Normalize`.
//! A plain BERT directory without those files gets mean pooling and L2
//! normalization, what most sentence models use.

use std::path::Path;

use mlx_rs::Array;

use super::bert::{Bert, BertConfig};
use crate::engine::model::LoadError;
use crate::engine::model::weights::MlxResult;

/// How token states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The average over the input's tokens (special tokens included).
    Mean,
    /// The first token's state (`[CLS]`).
    Cls,
    /// The last token's state: decoder models, whose last position has seen
    /// the whole input.
    LastToken,
}

impl Pooling {
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::LastToken => "last_token",
        }
    }

    /// Pools one input's `[length, hidden]` states (row-major) into `out`,
    /// then L2-normalizes it when `normalize`.
    pub fn pool(self, states: &[f32], hidden: usize, normalize: bool) -> Vec<f32> {
        let rows = states.len() / hidden;
        let mut out = match self {
            Pooling::Cls => states[..hidden].to_vec(),
            Pooling::LastToken => states[(rows - 1) * hidden..rows * hidden].to_vec(),
            Pooling::Mean => {
                let mut sum = vec![0f64; hidden];
                for row in states.chunks_exact(hidden) {
                    sum.iter_mut().zip(row).for_each(|(s, &v)| *s += v as f64);
                }
                sum.iter().map(|s| (s / rows as f64) as f32).collect()
            }
        };
        if normalize {
            l2_normalize(&mut out);
        }
        out
    }
}

/// Scales `v` to unit length (as torch's `F.normalize`, eps 1e-12).
fn l2_normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt();
    let scale = 1.0 / norm.max(1e-12);
    v.iter_mut().for_each(|x| *x = (*x as f64 * scale) as f32);
}

/// An encoder model and what sentence-transformers wraps around it.
pub struct SentenceModel {
    pub encoder: Bert,
    pub tokenizer: tokenizers::Tokenizer,
    pub pooling: Pooling,
    pub normalize: bool,
    /// Longest input in tokens, special tokens included.
    pub max_tokens: usize,
}

impl SentenceModel {
    /// True for a directory whose `config.json` names an encoder this
    /// module runs (`model_type` `bert`).
    pub fn is_encoder_dir(dir: &Path) -> bool {
        read_json(&dir.join("config.json"))
            .is_ok_and(|json| json["model_type"].as_str() == Some("bert"))
    }

    pub fn load(dir: &Path) -> Result<SentenceModel, LoadError> {
        let config = BertConfig::from_json(&read_json(&dir.join("config.json"))?)?;
        let (pooling, normalize) = pooling_of(dir)?;
        let path = dir.join("tokenizer.json");
        let mut tokenizer = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| LoadError::Tokenizer(format!("{}: {e}", path.display())))?;
        // Exported tokenizers often pad and truncate to a fixed length; the
        // engine batches and checks lengths itself.
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(None)
            .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        let max_tokens = read_json(&dir.join("sentence_bert_config.json"))
            .ok()
            .and_then(|c| c["max_seq_length"].as_u64())
            .map_or(config.max_position_embeddings, |n| n as usize)
            .min(config.max_position_embeddings);
        let encoder = Bert::load(dir, config)?;
        Ok(SentenceModel {
            encoder,
            tokenizer,
            pooling,
            normalize,
            max_tokens,
        })
    }

    /// One vector per input of a batch (token ids with special tokens);
    /// `after_layer` as in [`Bert::forward`].
    pub fn embed(
        &self,
        inputs: &[&[u32]],
        after_layer: &mut dyn FnMut(&Array) -> MlxResult<()>,
    ) -> MlxResult<Vec<Vec<f32>>> {
        let lengths: Vec<usize> = inputs.iter().map(|i| i.len()).collect();
        let ids: Vec<u32> = inputs.concat();
        let states: Array = self.encoder.forward(&ids, &lengths, after_layer)?;
        states.eval()?;
        let hidden = self.encoder.config.hidden_size;
        let states = states.as_slice::<f32>();
        let mut start = 0;
        Ok(lengths
            .iter()
            .map(|&n| {
                let own = &states[start * hidden..(start + n) * hidden];
                start += n;
                self.pooling.pool(own, hidden, self.normalize)
            })
            .collect())
    }
}

/// The pooling and normalization sentence-transformers' modules declare.
fn pooling_of(dir: &Path) -> Result<(Pooling, bool), LoadError> {
    let Ok(modules) = read_json(&dir.join("modules.json")) else {
        return Ok((Pooling::Mean, true));
    };
    let modules = modules.as_array().cloned().unwrap_or_default();
    let of_type = |suffix: &str| {
        modules
            .iter()
            .find(|m| m["type"].as_str().is_some_and(|t| t.ends_with(suffix)))
    };
    let normalize = of_type(".Normalize").is_some();
    let Some(pooling) = of_type(".Pooling") else {
        return Ok((Pooling::Mean, normalize));
    };
    let config = read_json(
        &dir.join(pooling["path"].as_str().unwrap_or("1_Pooling"))
            .join("config.json"),
    )?;
    let on = |key: &str| config[key].as_bool() == Some(true);
    let pooling = match (
        on("pooling_mode_mean_tokens"),
        on("pooling_mode_cls_token"),
        on("pooling_mode_lasttoken"),
    ) {
        (true, false, false) => Pooling::Mean,
        (false, true, false) => Pooling::Cls,
        (false, false, true) => Pooling::LastToken,
        _ => {
            return Err(LoadError::UnsupportedArchitecture(format!(
                "the pooling of {} (supported: exactly one of mean, cls, last token)",
                dir.display()
            )));
        }
    };
    Ok((pooling, normalize))
}

fn read_json(path: &Path) -> Result<serde_json::Value, LoadError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| LoadError::Io(path.to_owned(), e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| LoadError::Io(path.to_owned(), e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_takes_the_rows_it_names_and_normalizes() {
        let states = [1.0, 2.0, 3.0, 6.0];
        assert_eq!(Pooling::Mean.pool(&states, 2, false), vec![2.0, 4.0]);
        assert_eq!(Pooling::Cls.pool(&states, 2, false), vec![1.0, 2.0]);
        assert_eq!(Pooling::LastToken.pool(&states, 2, false), vec![3.0, 6.0]);
        let unit = Pooling::LastToken.pool(&[0.0, 0.0, 3.0, 4.0], 2, true);
        assert_eq!(unit, vec![0.6, 0.8]);
        // A zero vector stays zero rather than becoming NaN.
        assert_eq!(Pooling::Cls.pool(&[0.0, 0.0], 2, true), vec![0.0, 0.0]);
    }
}
