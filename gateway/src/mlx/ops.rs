//! MLX operations mlx-rs does not expose publicly, called through mlx-c.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Stream};

/// Runs an mlx-c operation that writes one new array into `res`.
fn new_array(
    name: &str,
    make: impl FnOnce(*mut mlx_sys::mlx_array) -> i32,
) -> Result<Array, Exception> {
    // SAFETY: `res` starts empty; on success it holds a new array whose
    // ownership passes to `Array::from_ptr`, on failure it is freed here.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        if make(&mut res) == 0 {
            Ok(Array::from_ptr(res))
        } else {
            mlx_sys::mlx_array_free(res);
            Err(Exception::custom(format!("MLX {name} failed")))
        }
    }
}

/// `src` with the block at `start` (one index per axis) replaced by
/// `update`: one graph node, where mlx-rs would build it from indices.
pub fn slice_update(src: &Array, update: &Array, start: &[i32]) -> Result<Array, Exception> {
    let stop: Vec<i32> = start
        .iter()
        .zip(update.shape())
        .map(|(s, n)| s + n)
        .collect();
    let strides = vec![1; start.len()];
    let stream = Stream::thread_local_or_default();
    // SAFETY: the arrays are live; the index slices outlive the call.
    new_array("slice_update", |res| unsafe {
        mlx_sys::mlx_slice_update(
            res,
            src.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            start.len(),
            stop.as_ptr(),
            stop.len(),
            strides.as_ptr(),
            strides.len(),
            stream.as_ref().as_ptr(),
        )
    })
}
