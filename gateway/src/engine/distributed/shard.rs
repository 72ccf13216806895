//! Cutting weights to a rank's shard: output rows of the column-parallel
//! projections (q/k/v, gate/up), input columns of the row-parallel ones
//! (o, down). A GGUF file is cut tensor by tensor as it is read
//! ([`TensorShard`]), so a rank never holds the whole model; safetensors
//! directories, which MLX reads lazily, are cut block by block
//! ([`column_parallel`], [`row_parallel`]), each whole block dropped once
//! cut.

use std::ops::Range;

use mlx_rs::Array;
use mlx_rs::ops::indexing::IndexOp;

use super::plan::ShardPlan;
use crate::engine::model::ModelConfig;
use crate::engine::model::weights::{Kernel, Linear, MlxResult};

fn own(sliced: Array) -> MlxResult<Array> {
    // A slice is a view of the whole buffer; `contiguous` copies it out
    // (MLX shares the buffer only when it is at most 16 KiB larger).
    let copy = sliced.contiguous()?;
    copy.eval()?;
    Ok(copy)
}

fn span(r: &Range<usize>) -> Range<i32> {
    r.start as i32..r.end as i32
}

/// Output rows `rows` of every stored array.
pub fn kernel_rows(kernel: &Kernel, rows: Range<usize>) -> MlxResult<Kernel> {
    kernel.clone().map_rows(|a| own(a.index(span(&rows))))
}

/// Input columns `cols`: for quantized storage both bounds must be
/// multiples of the group size (then also of the packing: groups are >= 16
/// values, and 16 * bits is a whole number of u32 words for every width).
pub fn kernel_cols(kernel: &Kernel, cols: Range<usize>) -> MlxResult<Kernel> {
    Ok(match kernel {
        Kernel::Dense(w) => Kernel::Dense(own(w.index((.., span(&cols))))?),
        Kernel::Quantized {
            weight,
            scales,
            biases,
            group_size,
            bits,
        } => {
            let g = *group_size as usize;
            if !cols.start.is_multiple_of(g) || !cols.end.is_multiple_of(g) {
                return Err(mlx_rs::error::Exception::custom(format!(
                    "columns {cols:?} are not on groups of {g}"
                )));
            }
            let words = |c: usize| c * *bits as usize / 32;
            let packed = words(cols.start)..words(cols.end);
            let groups = cols.start / g..cols.end / g;
            Kernel::Quantized {
                weight: own(weight.index((.., span(&packed))))?,
                scales: own(scales.index((.., span(&groups))))?,
                biases: own(biases.index((.., span(&groups))))?,
                group_size: *group_size,
                bits: *bits,
            }
        }
    })
}

/// q/k/v/gate/up: rows of the matrix and of its bias.
pub fn column_parallel(linear: &Linear, rows: Range<usize>) -> MlxResult<Linear> {
    Ok(Linear {
        kernel: kernel_rows(&linear.kernel, rows.clone())?,
        bias: match &linear.bias {
            Some(b) => Some(own(b.index(span(&rows)))?),
            None => None,
        },
    })
}

/// o/down: columns of the matrix; the bias (added once by the all-sum)
/// only where `keep_bias`.
pub fn row_parallel(linear: &Linear, cols: Range<usize>, keep_bias: bool) -> MlxResult<Linear> {
    Ok(Linear {
        kernel: kernel_cols(&linear.kernel, cols)?,
        bias: if keep_bias { linear.bias.clone() } else { None },
    })
}

/// Which slice of each tensor (by its HF name) a rank keeps, for cutting a
/// file as it is read: the same slices [`column_parallel`] and
/// [`row_parallel`] take from loaded layers.
pub struct TensorShard<'a> {
    pub plan: &'a ShardPlan,
    /// The whole model's shape (the columns a row-parallel tensor had).
    pub config: &'a ModelConfig,
}

/// How a projection is cut.
enum Cut {
    Rows(Range<usize>),
    /// Input columns of a matrix whose whole width is the second field.
    Cols(Range<usize>, usize),
}

impl TensorShard<'_> {
    /// This rank's part of `array` (the tensor `name`): a copy of its slice,
    /// all of it (norms, embeddings, the output head, unsplit attention),
    /// or nothing (a row-parallel bias on a rank that does not add it).
    pub fn keep(&self, name: &str, array: Array) -> MlxResult<Option<Array>> {
        let Some((projection, part)) = name
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(_, rest)| rest.split_once('.'))
            .and_then(|(_, rest)| rest.split_once('.'))
        else {
            return Ok(Some(array));
        };
        let (plan, c) = (self.plan, self.config);
        let split = plan.attention_is_split();
        let cut = match projection {
            "q_proj" if split => Cut::Rows(plan.q_rows()),
            "k_proj" | "v_proj" if split => Cut::Rows(plan.kv_rows()),
            "o_proj" if split => Cut::Cols(plan.q_rows(), c.heads * c.head_dim),
            "gate_proj" | "up_proj" => Cut::Rows(plan.ffn.clone()),
            "down_proj" => Cut::Cols(plan.ffn.clone(), c.intermediate_size),
            _ => return Ok(Some(array)),
        };
        let kept = match (cut, part) {
            (Cut::Rows(rows), _) => own(array.index(span(&rows)))?,
            (Cut::Cols(_, _), "bias") if !plan.keeps_row_parallel_bias() => return Ok(None),
            (Cut::Cols(_, _), "bias") => array,
            (Cut::Cols(cols, whole), _) => {
                // Codes pack `whole` columns into fewer u32 words, scales and
                // biases hold one per group: the same fraction either way.
                let stored = array.shape()[1] as usize;
                let at = |col: usize| col * stored / whole;
                if at(cols.start) * whole != cols.start * stored
                    || at(cols.end) * whole != cols.end * stored
                {
                    return Err(mlx_rs::error::Exception::custom(format!(
                        "{name}: columns {cols:?} of {whole} do not fall on its {stored} stored columns"
                    )));
                }
                own(array.index((.., span(&(at(cols.start)..at(cols.end))))))?
            }
        };
        Ok(Some(kept))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::distributed::plan::tests::config;

    fn values(rows: i32, cols: i32) -> Array {
        let data: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
        Array::from_slice(&data, &[rows, cols])
    }

    #[test]
    fn a_file_is_cut_to_the_ranks_rows_and_columns_as_it_is_read() {
        // 4 heads (2 kv, head_dim 64): rank 1 of 2 keeps q rows 128..256,
        // k/v rows 64..128, o columns 128..256; the MLP splits 64..128.
        let c = config(4, 2, 64, 128);
        let plan = ShardPlan::new(&c, 1, 2, 32, 32).unwrap();
        let shard = TensorShard {
            plan: &plan,
            config: &c,
        };
        let keep = |name: &str, a: Array| shard.keep(name, a).unwrap();
        let q = keep("model.layers.0.self_attn.q_proj.weight", values(256, 64)).unwrap();
        assert_eq!(q.shape(), &[128, 64]);
        assert_eq!(q.as_slice::<f32>()[0], (128 * 64) as f32);
        let k = keep(
            "model.layers.1.self_attn.k_proj.bias",
            values(128, 1).flatten(None, None).unwrap(),
        )
        .unwrap();
        assert_eq!(
            k.as_slice::<f32>(),
            (64..128).map(|v| v as f32).collect::<Vec<_>>()
        );
        // o_proj stored 4-bit in groups of 32: 256 columns are 32 code
        // words and 8 scales a row; rank 1 keeps the second half of each.
        let codes = keep("model.layers.0.self_attn.o_proj.weight", values(64, 32)).unwrap();
        assert_eq!(codes.shape(), &[64, 16]);
        assert_eq!(codes.as_slice::<f32>()[0], 16.0);
        let scales = keep("model.layers.0.self_attn.o_proj.scales", values(64, 8)).unwrap();
        assert_eq!(scales.shape(), &[64, 4]);
        assert_eq!(scales.as_slice::<f32>()[0], 4.0);
        let down = keep("model.layers.0.mlp.down_proj.weight", values(64, 128)).unwrap();
        assert_eq!(down.shape(), &[64, 64]);
        assert_eq!(down.as_slice::<f32>()[0], 64.0);
        let gate = keep("model.layers.0.mlp.gate_proj.weight", values(128, 64)).unwrap();
        assert_eq!(gate.shape(), &[64, 64]);
        // The all-sum adds a row-parallel bias once: rank 0 keeps it.
        assert!(keep("model.layers.0.mlp.down_proj.bias", values(1, 64)).is_none());
        // Norms, embeddings and the head stay whole.
        let norm = keep("model.norm.weight", values(1, 64)).unwrap();
        assert_eq!(norm.shape(), &[1, 64]);
        let embed = keep("model.embed_tokens.weight", values(1000, 64)).unwrap();
        assert_eq!(embed.shape(), &[1000, 64]);
        // Columns off the stored groups are an error, not a wrong cut.
        let odd = config(4, 2, 64, 96);
        let plan = ShardPlan::new(&odd, 1, 2, 32, 32).unwrap();
        let shard = TensorShard {
            plan: &plan,
            config: &odd,
        };
        assert!(
            shard
                .keep("model.layers.0.mlp.down_proj.scales", values(64, 2))
                .is_err()
        );
    }
}
