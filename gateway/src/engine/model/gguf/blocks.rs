//! The GGML block formats, written from their definitions: each quantized
//! type's blocks decoded to f32 ([`decode_blocks`]) or split into integer
//! codes with a scale and bias per group ([`affine_blocks`]), the form MLX's
//! affine layout stores.

use super::GgmlType;

/// Decodes whole blocks of `kind` from `bytes` into `out` (one value per
/// slot). `None` if the type is not decodable or the lengths disagree.
pub fn decode_blocks(kind: GgmlType, bytes: &[u8], out: &mut [f32]) -> Option<()> {
    let (values, size) = kind.block()?;
    if !bytes.len().is_multiple_of(size) || bytes.len() / size * values != out.len() {
        return None;
    }
    let decode: fn(&[u8], &mut [f32]) = match kind {
        GgmlType::F32 => |b, o| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, o| o[0] = f16_at(b, 0),
        GgmlType::BF16 => |b, o| o[0] = f32::from_bits(u32::from(u16_at(b, 0)) << 16),
        GgmlType::Q4_0 => decode_q4_0,
        GgmlType::Q4_1 => decode_q4_1,
        GgmlType::Q5_0 => decode_q5_0,
        GgmlType::Q5_1 => decode_q5_1,
        GgmlType::Q8_0 => decode_q8_0,
        GgmlType::Q4K => decode_q4_k,
        GgmlType::Q5K => decode_q5_k,
        GgmlType::Q6K => decode_q6_k,
        GgmlType::Other(_) => return None,
    };
    for (block, out) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(values)) {
        decode(block, out);
    }
    Some(())
}

// Block decoders, written from the GGML block definitions. Callers hand each
// one exactly one block (`chunks_exact`), so the fixed indices are in bounds.

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16_at(b, at)).to_f32()
}

/// Q4_0: f16 scale d, 16 bytes of nibbles; value = (q - 8) * d. Byte j holds
/// value j (low nibble) and value j + 16 (high nibble).
fn decode_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        out[j] = (i32::from(q & 0xf) - 8) as f32 * d;
        out[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

/// Q4_1: f16 scale d and min m, nibbles as Q4_0; value = q * d + m.
fn decode_q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        out[j] = f32::from(q & 0xf) * d + m;
        out[j + 16] = f32::from(q >> 4) * d + m;
    }
}

/// The fifth bit of value `j` of a Q5 block, from its 32-bit high-bit mask.
fn high_bit(mask: u32, j: usize) -> u8 {
    (((mask >> j) & 1) as u8) << 4
}

/// Q5_0: f16 d, u32 of fifth bits, nibbles as Q4_0; value = (q - 16) * d.
fn decode_q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let mask = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, &q) in b[6..22].iter().enumerate() {
        let lo = (q & 0xf) | high_bit(mask, j);
        let hi = (q >> 4) | high_bit(mask, j + 16);
        out[j] = (i32::from(lo) - 16) as f32 * d;
        out[j + 16] = (i32::from(hi) - 16) as f32 * d;
    }
}

/// Q5_1: f16 d and m, u32 of fifth bits, nibbles; value = q * d + m.
fn decode_q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let mask = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, &q) in b[8..24].iter().enumerate() {
        out[j] = f32::from((q & 0xf) | high_bit(mask, j)) * d + m;
        out[j + 16] = f32::from((q >> 4) | high_bit(mask, j + 16)) * d + m;
    }
}

/// Q8_0: f16 d, 32 signed bytes; value = q * d.
fn decode_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K / Q5_K block,
/// packed into 12 bytes: sub-blocks 0-3 use the low 6 bits of bytes j and
/// j + 4; sub-blocks 4-7 take their low 4 bits from byte j + 4's nibbles and
/// their top 2 bits from the spare top bits of bytes j - 4 and j.
fn scale_min(packed: &[u8], j: usize) -> (f32, f32) {
    let (scale, min) = if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0xf) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    };
    (f32::from(scale), f32::from(min))
}

/// Q4_K: 256 values in 8 sub-blocks of 32, f16 d and dmin, 12 bytes of
/// 6-bit scales/mins, 128 bytes of nibbles. Each 32 bytes of nibbles hold
/// two sub-blocks: low nibbles the first, high nibbles the second.
/// value = d * scale * q - dmin * min.
fn decode_q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let packed = &b[4..16];
    for (pair, (qs, out)) in b[16..144]
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (s1, m1) = scale_min(packed, 2 * pair);
        let (s2, m2) = scale_min(packed, 2 * pair + 1);
        let (d1, m1, d2, m2) = (d * s1, dmin * m1, d * s2, dmin * m2);
        for (l, &q) in qs.iter().enumerate() {
            out[l] = d1 * f32::from(q & 0xf) - m1;
            out[l + 32] = d2 * f32::from(q >> 4) - m2;
        }
    }
}

/// Q5_K: as Q4_K plus 32 bytes of fifth bits: bit 2p of byte l is the fifth
/// bit of value l of sub-block 2p, bit 2p + 1 that of sub-block 2p + 1.
fn decode_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let packed = &b[4..16];
    let high = &b[16..48];
    for (pair, (qs, out)) in b[48..176]
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (s1, m1) = scale_min(packed, 2 * pair);
        let (s2, m2) = scale_min(packed, 2 * pair + 1);
        let (d1, m1, d2, m2) = (d * s1, dmin * m1, d * s2, dmin * m2);
        for (l, (&q, &h)) in qs.iter().zip(high).enumerate() {
            let lo = (q & 0xf) | (((h >> (2 * pair)) & 1) << 4);
            let hi = (q >> 4) | (((h >> (2 * pair + 1)) & 1) << 4);
            out[l] = d1 * f32::from(lo) - m1;
            out[l + 32] = d2 * f32::from(hi) - m2;
        }
    }
}

/// Q6_K: 256 values in 16 sub-blocks of 16; 128 bytes of low nibbles, 64
/// bytes of 2-bit high parts, 16 signed 8-bit scales, f16 d.
/// value = d * scale * (q - 32). Each half (128 values) uses 64 low-nibble
/// bytes and 32 high bytes: value l + 32k (k = 0..4) takes its low nibble from
/// byte l (k even) or l + 32 (k odd), low half for k < 2, and bits 2k..2k+2 of
/// high byte l.
fn decode_q6_k(b: &[u8], out: &mut [f32]) {
    let mut codes = [0u8; 256];
    q6_k_codes(b, &mut codes);
    for (g, (out, codes)) in out
        .chunks_exact_mut(16)
        .zip(codes.chunks_exact(16))
        .enumerate()
    {
        let scale = q6_k_scale(b, g);
        for (value, &code) in out.iter_mut().zip(codes) {
            *value = scale * (i32::from(code) - 32) as f32;
        }
    }
}

/// A Q6_K block's 256 six-bit codes (`q`, the value being `scale * (q - 32)`).
fn q6_k_codes(b: &[u8], codes: &mut [u8]) {
    for half in 0..2 {
        let low = &b[64 * half..64 * half + 64];
        let high = &b[128 + 32 * half..128 + 32 * half + 32];
        let codes = &mut codes[128 * half..128 * half + 128];
        for l in 0..32 {
            let h = high[l];
            codes[l] = (low[l] & 0xf) | ((h & 3) << 4);
            codes[l + 32] = (low[l + 32] & 0xf) | (((h >> 2) & 3) << 4);
            codes[l + 64] = (low[l] >> 4) | (((h >> 4) & 3) << 4);
            codes[l + 96] = (low[l + 32] >> 4) | (((h >> 6) & 3) << 4);
        }
    }
}

/// The scale of sub-block `g` (16 values) of a Q6_K block: `d * scale_g`,
/// an exact f32 product (11 by 8 significant bits).
fn q6_k_scale(b: &[u8], g: usize) -> f32 {
    f16_at(b, 208) * f32::from(b[192 + g] as i8)
}

/// One block -> its codes, and a scale and bias per group of codes.
type AffineSplit = fn(&[u8], &mut [u8], &mut [f32], &mut [f32]);

/// Values per scale of a quantized type whose blocks are affine codes.
fn affine_group_size(kind: GgmlType) -> Option<usize> {
    match kind {
        GgmlType::Q6K => Some(16),
        GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q5_0
        | GgmlType::Q5_1
        | GgmlType::Q8_0
        | GgmlType::Q4K
        | GgmlType::Q5K => Some(32),
        _ => None,
    }
}

/// Splits blocks into integer codes and a scale and bias per group (32
/// values; 16 for Q6_K) with `value = scale * code + bias`. `None` for
/// floats or mismatched lengths.
pub fn affine_blocks(
    kind: GgmlType,
    bytes: &[u8],
    codes: &mut [u8],
    scales: &mut [f32],
    biases: &mut [f32],
) -> Option<()> {
    let (values, size) = kind.block()?;
    let blocks = bytes.len() / size;
    let groups = values / affine_group_size(kind)?;
    if !bytes.len().is_multiple_of(size)
        || codes.len() != blocks * values
        || scales.len() != blocks * groups
        || biases.len() != blocks * groups
    {
        return None;
    }
    let split: AffineSplit = match kind {
        GgmlType::Q4_0 => |b, c, s, m| {
            nibbles(&b[2..18], c);
            s[0] = f16_at(b, 0);
            m[0] = -8.0 * s[0];
        },
        GgmlType::Q4_1 => |b, c, s, m| {
            nibbles(&b[4..20], c);
            (s[0], m[0]) = (f16_at(b, 0), f16_at(b, 2));
        },
        GgmlType::Q5_0 => |b, c, s, m| {
            nibbles(&b[6..22], c);
            fifth_bits(u32::from_le_bytes([b[2], b[3], b[4], b[5]]), c);
            s[0] = f16_at(b, 0);
            m[0] = -16.0 * s[0];
        },
        GgmlType::Q5_1 => |b, c, s, m| {
            nibbles(&b[8..24], c);
            fifth_bits(u32::from_le_bytes([b[4], b[5], b[6], b[7]]), c);
            (s[0], m[0]) = (f16_at(b, 0), f16_at(b, 2));
        },
        GgmlType::Q8_0 => |b, c, s, m| {
            for (code, &q) in c.iter_mut().zip(&b[2..34]) {
                *code = (q as i8 as i16 + 128) as u8;
            }
            s[0] = f16_at(b, 0);
            m[0] = -128.0 * s[0];
        },
        GgmlType::Q4K => |b, c, s, m| k_quant_affine(b, &b[16..144], None, c, s, m),
        GgmlType::Q5K => |b, c, s, m| k_quant_affine(b, &b[48..176], Some(&b[16..48]), c, s, m),
        GgmlType::Q6K => |b, c, s, m| {
            q6_k_codes(b, c);
            for (g, (s, m)) in s.iter_mut().zip(m).enumerate() {
                *s = q6_k_scale(b, g);
                *m = -32.0 * *s;
            }
        },
        _ => return None,
    };
    for (((block, c), s), m) in bytes
        .chunks_exact(size)
        .zip(codes.chunks_exact_mut(values))
        .zip(scales.chunks_exact_mut(groups))
        .zip(biases.chunks_exact_mut(groups))
    {
        split(block, c, s, m);
    }
    Some(())
}

/// 16 bytes of nibbles -> 32 codes: low nibbles are values 0-15, high 16-31.
fn nibbles(qs: &[u8], codes: &mut [u8]) {
    for (j, &q) in qs.iter().enumerate() {
        codes[j] = q & 0xf;
        codes[j + 16] = q >> 4;
    }
}

fn fifth_bits(mask: u32, codes: &mut [u8]) {
    for (j, code) in codes.iter_mut().enumerate() {
        *code |= high_bit(mask, j);
    }
}

/// Q4_K / Q5_K: 8 groups of 32 with scale `d * sc` and bias `-dmin * m`.
fn k_quant_affine(
    b: &[u8],
    qs: &[u8],
    high: Option<&[u8]>,
    codes: &mut [u8],
    scales: &mut [f32],
    biases: &mut [f32],
) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let packed = &b[4..16];
    for (pair, (qs, codes)) in qs
        .chunks_exact(32)
        .zip(codes.chunks_exact_mut(64))
        .enumerate()
    {
        for half in 0..2 {
            let (sc, min) = scale_min(packed, 2 * pair + half);
            scales[2 * pair + half] = d * sc;
            biases[2 * pair + half] = -(dmin * min);
        }
        for (l, &q) in qs.iter().enumerate() {
            codes[l] = q & 0xf;
            codes[l + 32] = q >> 4;
            if let Some(high) = high {
                codes[l] |= ((high[l] >> (2 * pair)) & 1) << 4;
                codes[l + 32] |= ((high[l] >> (2 * pair + 1)) & 1) << 4;
            }
        }
    }
}
