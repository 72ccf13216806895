//! Activations as MLX compiled functions, each compiled once per thread.
//!
//! Why not `mlx_rs::nn::{silu, gelu, gelu_approximate}`: they are compiled
//! functions too, but mlx-rs (0.33) makes a new one on every call, with a
//! new function id, so MLX traces and fuses the function again each time
//! (host work in every layer of every step) and forgets it on return. Here
//! each is compiled once on each thread and reused, and a gated activation
//! fuses its multiply as well: one kernel where the GPU ran two, as
//! mlx-lm's compiled `swiglu` does. The arithmetic is the same ops, in the
//! same order and dtypes, as the mlx-rs functions they replace.

use std::cell::RefCell;
use std::f32::consts::PI;

use mlx_rs::error::Exception;
use mlx_rs::ops::{erf, multiply, sigmoid, sqrt, tanh};
use mlx_rs::transforms::compile::compile;
use mlx_rs::{Array, array};

type Unary = Box<dyn FnMut(&Array) -> Result<Array, Exception>>;
type Binary = Box<dyn FnMut(&Array, &Array) -> Result<Array, Exception>>;

/// `x * sigmoid(x)`.
fn silu_of(x: &Array) -> Result<Array, Exception> {
    x.multiply(sigmoid(x)?)
}

/// GELU, tanh form: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
fn gelu_tanh_of(x: &Array) -> Result<Array, Exception> {
    array!(0.5).multiply(x)?.multiply(
        array!(1.0).add(tanh(
            &(sqrt(&array!(2.0 / PI))?
                .multiply(x + array!(0.044715).multiply(x.power(&array!(3))?)?)?),
        )?)?,
    )
}

/// GELU, exact: `x (1 + erf(x / sqrt 2)) / 2`.
fn gelu_of(x: &Array) -> Result<Array, Exception> {
    x.multiply(array!(1) + erf(&(x / array!(2f32.sqrt())))?)?
        .divide(array!(2.0))
}

thread_local! {
    static SWIGLU: RefCell<Binary> = RefCell::new({
        let mut f = compile(|(gate, up): (&Array, &Array)| multiply(silu_of(gate)?, up), true);
        Box::new(move |gate, up| f((gate, up)))
    });
    static GEGLU_TANH: RefCell<Binary> = RefCell::new({
        let mut f = compile(|(gate, up): (&Array, &Array)| multiply(gelu_tanh_of(gate)?, up), true);
        Box::new(move |gate, up| f((gate, up)))
    });
    static GELU: RefCell<Unary> = RefCell::new({
        let mut f = compile(gelu_of, true);
        Box::new(move |x| f(x))
    });
    static GELU_TANH: RefCell<Unary> = RefCell::new({
        let mut f = compile(gelu_tanh_of, true);
        Box::new(move |x| f(x))
    });
}

/// SwiGLU's gated activation, `silu(gate) * up`, one fused kernel.
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array, Exception> {
    SWIGLU.with(|f| (f.borrow_mut())(gate, up))
}

/// GeGLU (tanh form, Gemma's), `gelu_tanh(gate) * up`, one fused kernel.
pub fn geglu_tanh(gate: &Array, up: &Array) -> Result<Array, Exception> {
    GEGLU_TANH.with(|f| (f.borrow_mut())(gate, up))
}

/// GELU (the exact, erf form).
pub fn gelu(x: &Array) -> Result<Array, Exception> {
    GELU.with(|f| (f.borrow_mut())(x))
}

/// GELU (tanh form).
pub fn gelu_tanh(x: &Array) -> Result<Array, Exception> {
    GELU_TANH.with(|f| (f.borrow_mut())(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each fused activation equals the mlx-rs ops it replaces, over shapes
    /// that change between calls, in float32 and bfloat16: bit for bit on
    /// the CPU; on CUDA within a rounding of the result (a fused kernel
    /// rounds once where the ops round after each; seen on an H100).
    #[test]
    fn compiled_activations_equal_the_ops_they_replace() {
        let fused_rounding = crate::mlx::Backend::detect() == crate::mlx::Backend::Cuda;
        for dtype in [mlx_rs::Dtype::Float32, mlx_rs::Dtype::Bfloat16] {
            for shape in [[1, 1, 64], [3, 5, 96], [2, 1, 64]] {
                let gate = mlx_rs::random::normal::<f32>(&shape, None, Some(3.0), None)
                    .unwrap()
                    .as_dtype(dtype)
                    .unwrap();
                let up = mlx_rs::random::normal::<f32>(&shape, None, None, None)
                    .unwrap()
                    .as_dtype(dtype)
                    .unwrap();
                let same = |a: Array, b: Array| {
                    assert_eq!(a.dtype(), b.dtype());
                    let (a, b) = (
                        a.as_dtype(mlx_rs::Dtype::Float32).unwrap(),
                        b.as_dtype(mlx_rs::Dtype::Float32).unwrap(),
                    );
                    if !fused_rounding {
                        assert_eq!(
                            a.as_slice::<f32>(),
                            b.as_slice::<f32>(),
                            "{dtype:?} {shape:?}"
                        );
                        return;
                    }
                    // bfloat16 keeps 8 bits: one rounding is 2^-8 of the value.
                    let ulp = if dtype == mlx_rs::Dtype::Float32 {
                        1e-6
                    } else {
                        8e-3
                    };
                    for (x, y) in a.as_slice::<f32>().iter().zip(b.as_slice::<f32>()) {
                        assert!(
                            (x - y).abs() <= ulp * (1.0 + y.abs()),
                            "{dtype:?} {shape:?}: {x} against {y}"
                        );
                    }
                };
                let silu = mlx_rs::nn::silu(&gate).unwrap();
                same(swiglu(&gate, &up).unwrap(), multiply(&silu, &up).unwrap());
                let gelu_tanh_ops = mlx_rs::nn::gelu_approximate(&gate).unwrap();
                same(
                    geglu_tanh(&gate, &up).unwrap(),
                    multiply(&gelu_tanh_ops, &up).unwrap(),
                );
                same(gelu_tanh(&gate).unwrap(), gelu_tanh_ops);
                same(gelu(&gate).unwrap(), mlx_rs::nn::gelu(&gate).unwrap());
            }
        }
    }
}
