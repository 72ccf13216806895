//! Cutting a loaded layer's weights to a rank's shard: output rows of the
//! column-parallel projections (q/k/v, gate/up), input columns of the
//! row-parallel ones (o, down). Each rank loads the whole file and keeps
//! its slices; the rest is freed once the shard is built.

use std::ops::Range;

use mlx_rs::Array;
use mlx_rs::ops::indexing::IndexOp;

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
