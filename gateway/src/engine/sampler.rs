//! Next-token choice from one row of logits, on the host.
//!
//! A row is ~50-260 k floats, so this costs well under a millisecond, and doing
//! it in Rust keeps every request's randomness its own (seeded per request:
//! same seed, same output) regardless of what it is batched with.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::api::SamplingParams;

/// The chosen token and, when asked, its log-probability and the top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub token: u32,
    /// Only when logprobs were asked for: the normaliser is an `exp` over the
    /// whole vocabulary, a few percent of a small model's decode step.
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// How often each token was generated (presence/frequency penalties).
    generated: HashMap<u32, u32>,
    /// Tokens seen in prompt or output (repetition penalty).
    seen: std::collections::HashSet<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Sampler {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Sampler {
            params,
            rng,
            generated: HashMap::new(),
            seen: prompt.iter().copied().collect(),
        }
    }

    /// Picks the next token from `logits` (modified in place). With
    /// `logprobs = Some(n)` it also reports the token's log-probability and
    /// the `n` most likely alternatives.
    /// Whether end-of-sequence tokens are never to be chosen.
    pub fn ignores_eos(&self) -> bool {
        self.params.ignore_eos
    }

    /// Whether this sampler's choice is the most likely token and nothing
    /// else (greedy, no bias or penalty), so a device may pick it.
    pub fn is_plain_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature <= 0.0
            && p.logit_bias.is_empty()
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
    }

    /// Notes `token`, picked elsewhere (see [`Sampler::is_plain_greedy`]),
    /// as [`Sampler::sample`] notes its own picks.
    pub fn record(&mut self, token: u32) -> Choice {
        *self.generated.entry(token).or_default() += 1;
        self.seen.insert(token);
        Choice {
            token,
            logprob: None,
            top: Vec::new(),
        }
    }

    pub fn sample(&mut self, logits: &mut [f32], logprobs: Option<usize>) -> Choice {
        self.apply_penalties(logits);
        let token = if self.params.temperature <= 0.0 {
            argmax(logits)
        } else {
            self.draw(logits)
        };
        let (logprob, top) = match logprobs {
            None => (None, Vec::new()),
            Some(n) => {
                let log_z = log_sum_exp(logits);
                let top = top_k_indices(logits, n)
                    .into_iter()
                    .map(|i| (i as u32, logits[i] - log_z))
                    .collect();
                (Some(logits[token] - log_z), top)
            }
        };
        Choice {
            logprob,
            top,
            ..self.record(token as u32)
        }
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        for (&token, &bias) in &p.logit_bias {
            if let Some(logit) = logits.get_mut(token as usize) {
                *logit += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            for &token in &self.seen {
                if let Some(logit) = logits.get_mut(token as usize) {
                    *logit = if *logit > 0.0 {
                        *logit / p.repetition_penalty
                    } else {
                        *logit * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&token, &count) in &self.generated {
                if let Some(logit) = logits.get_mut(token as usize) {
                    *logit -= p.presence_penalty + p.frequency_penalty * count as f32;
                }
            }
        }
    }

    /// Temperature, then top-k, min-p and top-p filters, then a weighted draw.
    fn draw(&mut self, logits: &[f32]) -> usize {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut candidates: Vec<(usize, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i, ((l - max) * inv_t).exp()))
            .collect();
        if candidates.is_empty() {
            return argmax(logits);
        }
        candidates.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            candidates.truncate(p.top_k);
        }
        if p.min_p > 0.0 {
            let floor = candidates[0].1 * p.min_p;
            candidates.retain(|c| c.1 >= floor);
        }
        if p.top_p < 1.0 {
            let total: f32 = candidates.iter().map(|c| c.1).sum();
            let mut mass = 0.0;
            let keep = candidates
                .iter()
                .position(|c| {
                    mass += c.1 / total;
                    mass >= p.top_p
                })
                .map_or(candidates.len(), |i| i + 1);
            candidates.truncate(keep);
        }
        let total: f32 = candidates.iter().map(|c| c.1).sum();
        let mut target = self.rng.random::<f32>() * total;
        for &(index, weight) in &candidates {
            target -= weight;
            if target <= 0.0 {
                return index;
            }
        }
        candidates.last().map_or(0, |c| c.0)
    }
}

/// Index of the largest value (the first on ties): the greedy choice.
pub fn argmax(values: &[f32]) -> usize {
    values
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 { (i, v) } else { best }
        })
        .0
}

fn log_sum_exp(values: &[f32]) -> f32 {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return max;
    }
    max + values.iter().map(|v| (v - max).exp()).sum::<f32>().ln()
}

fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut indices: Vec<usize> = (0..values.len()).collect();
    let k = k.min(values.len());
    if k == 0 {
        return Vec::new();
    }
    indices.select_nth_unstable_by(k - 1, |&a, &b| values[b].total_cmp(&values[a]));
    indices.truncate(k);
    indices.sort_unstable_by(|&a, &b| values[b].total_cmp(&values[a]));
    indices
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_takes_the_argmax_and_reports_normalised_logprobs() {
        let mut sampler = Sampler::new(params(0.0), &[]);
        let mut logits = vec![0.0, 3.0, 1.0, 2.0];
        let choice = sampler.sample(&mut logits, Some(2));
        assert_eq!(choice.token, 1);
        let logprob = choice.logprob.expect("logprobs were asked for");
        assert_eq!(choice.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3]);
        let total: f32 = [0.0f32, 3.0, 1.0, 2.0]
            .iter()
            .map(|l| (l - 3.0 + logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5, "probabilities sum to {total}");
        let plain = Sampler::new(params(0.0), &[]).sample(&mut [0.0, 3.0, 1.0], None);
        assert_eq!((plain.token, plain.logprob, plain.top.len()), (1, None, 0));
    }

    #[test]
    fn the_same_seed_gives_the_same_draws_and_another_seed_differs() {
        let draw = |seed| {
            let mut sampler = Sampler::new(
                SamplingParams {
                    seed: Some(seed),
                    ..params(1.0)
                },
                &[],
            );
            (0..64)
                .map(|_| sampler.sample(&mut [1.0; 50], None).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_k_one_and_logit_bias_decide_the_token() {
        let mut biased = Sampler::new(
            SamplingParams {
                logit_bias: [(0, 100.0)].into_iter().collect(),
                ..params(1.0)
            },
            &[],
        );
        assert_eq!(biased.sample(&mut [0.0, 5.0, 1.0], None).token, 0);
        let mut top1 = Sampler::new(
            SamplingParams {
                top_k: 1,
                ..params(1.5)
            },
            &[],
        );
        for _ in 0..20 {
            assert_eq!(top1.sample(&mut [0.0, 5.0, 4.9], None).token, 1);
        }
    }

    #[test]
    fn penalties_push_repeated_tokens_down() {
        let mut sampler = Sampler::new(
            SamplingParams {
                frequency_penalty: 2.0,
                ..params(0.0)
            },
            &[],
        );
        assert_eq!(sampler.sample(&mut [1.0, 0.5], None).token, 0);
        // Token 0 was generated once: 1.0 - 2.0 < 0.5.
        assert_eq!(sampler.sample(&mut [1.0, 0.5], None).token, 1);
        let mut repetition = Sampler::new(
            SamplingParams {
                repetition_penalty: 4.0,
                ..params(0.0)
            },
            &[0],
        );
        assert_eq!(repetition.sample(&mut [1.0, 0.5], None).token, 1);
    }
}
