//! Between a [`KvCache`]'s MLX arrays and the bytes of a cache file.
//!
//! Import hands MLX the mapped pages themselves through mlx-c's managed
//! constructor (`mlx_array_new_data_managed_payload`): each array keeps the
//! mapping alive through its deleter. MLX copies instead when its allocator
//! cannot wrap foreign memory (so CPU builds whose allocator lacks
//! `make_buffer`, and every CUDA build, where data must reach the device);
//! [`Imported::zero_copy`] says which happened. Either way the first decode
//! step copies once more, because a cache grows by concatenation.

use std::ffi::c_void;
use std::sync::Arc;

use mlx_rs::{Array, Dtype};

use super::file::{LayerBytes, MappedFile};
use crate::engine::model::KvCache;
use crate::engine::model::kv_cache::LayerCache;
use crate::engine::model::weights::MlxResult;

pub fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Float16 => "float16",
        Dtype::Bfloat16 => "bfloat16",
        _ => "float32",
    }
}

fn dtype_from_name(name: &str) -> Option<(Dtype, mlx_sys::mlx_dtype)> {
    match name {
        "float32" => Some((Dtype::Float32, mlx_sys::mlx_dtype__MLX_FLOAT32)),
        "float16" => Some((Dtype::Float16, mlx_sys::mlx_dtype__MLX_FLOAT16)),
        "bfloat16" => Some((Dtype::Bfloat16, mlx_sys::mlx_dtype__MLX_BFLOAT16)),
        _ => None,
    }
}

/// The bytes of an array, row-major.
fn array_bytes(array: &Array) -> MlxResult<Vec<u8>> {
    let contiguous = array.contiguous()?;
    contiguous.eval()?;
    // SAFETY: an evaluated row-contiguous array holds `nbytes` bytes at its
    // data pointer; `mlx_array_data_uint8` reinterprets without checking dtype.
    let bytes = unsafe {
        let data = mlx_sys::mlx_array_data_uint8(contiguous.as_ptr());
        std::slice::from_raw_parts(data, contiguous.nbytes()).to_vec()
    };
    Ok(bytes)
}

/// Copies every layer's keys and values out of MLX, for a file, in the
/// compute dtype the file's fingerprint names: a layer can hold another
/// (float32 keys of a float32 fixture model on a bfloat16 GPU), and its
/// bytes must match the dtype the file declares.
pub fn export(cache: &KvCache) -> MlxResult<Vec<LayerBytes>> {
    let dtype = crate::engine::model::compute_dtype();
    cache
        .settled()?
        .layers
        .iter()
        .map(|layer| {
            let Some((keys, values)) = layer.mlx_arrays()? else {
                return Err(mlx_rs::error::Exception::custom(
                    "cannot save an empty cache",
                ));
            };
            Ok(LayerBytes {
                window: layer.window,
                start: layer.start,
                shape: keys.shape().iter().map(|&d| d as usize).collect(),
                keys: array_bytes(&keys.as_dtype(dtype)?)?,
                values: array_bytes(&values.as_dtype(dtype)?)?,
            })
        })
        .collect()
}

/// A cache rebuilt from a mapped file.
pub struct Imported {
    pub cache: KvCache,
    /// Whether MLX uses the mapped pages in place.
    pub zero_copy: bool,
}

unsafe extern "C" fn release_mapping(payload: *mut c_void) {
    // SAFETY: `payload` is the `Box<Arc<MappedFile>>` leaked in `mapped_array`.
    drop(unsafe { Box::from_raw(payload as *mut Arc<MappedFile>) });
}

/// One tensor of `file` as an MLX array over the mapping; true if MLX kept
/// the pages rather than copying them.
fn mapped_array(
    file: &Arc<MappedFile>,
    tensor: &super::file::TensorEntry,
    shape: &[i32],
    dtype: mlx_sys::mlx_dtype,
) -> Result<(Array, bool), String> {
    let bytes = file.tensor(tensor);
    let data = bytes.as_ptr() as *mut c_void;
    let payload = Box::into_raw(Box::new(Arc::clone(file))) as *mut c_void;
    // SAFETY: `data` points at `bytes.len()` bytes (checked against the shape
    // at open) inside a private mapping that stays alive until MLX calls
    // `release_mapping` with `payload`, which owns an Arc of the mapping.
    let raw = unsafe {
        mlx_sys::mlx_array_new_data_managed_payload(
            data,
            shape.as_ptr(),
            shape.len() as i32,
            dtype,
            payload,
            Some(release_mapping),
        )
    };
    if raw.ctx.is_null() {
        // SAFETY: MLX did not take the payload.
        unsafe { release_mapping(payload) };
        return Err("MLX could not create an array over the mapped file".into());
    }
    // SAFETY: a fresh, owned mlx_array.
    let array = unsafe { Array::from_ptr(raw) };
    // SAFETY: reading the data pointer of an array created from data.
    let kept = std::ptr::eq(
        unsafe { mlx_sys::mlx_array_data_uint8(array.as_ptr()) },
        bytes.as_ptr(),
    );
    Ok((array, kept))
}

/// The cache a mapped file holds.
pub fn import(file: Arc<MappedFile>) -> Result<Imported, String> {
    let header = &file.info.header;
    let (_, dtype) = dtype_from_name(&header.fingerprint.dtype)
        .ok_or_else(|| format!("unknown dtype `{}`", header.fingerprint.dtype))?;
    let mut layers = Vec::with_capacity(header.layers.len());
    let mut zero_copy = true;
    for layer in &header.layers {
        let shape: Vec<i32> = layer.shape.iter().map(|&d| d as i32).collect();
        let (keys, kept_keys) = mapped_array(&file, &layer.keys, &shape, dtype)?;
        let (values, kept_values) = mapped_array(&file, &layer.values, &shape, dtype)?;
        zero_copy &= kept_keys && kept_values;
        layers.push(LayerCache::from_arrays(
            keys,
            values,
            layer.window,
            layer.start,
        ));
    }
    Ok(Imported {
        cache: KvCache {
            layers,
            offset: header.tokens.len(),
            slab: None,
            ticket: None,
        },
        zero_copy,
    })
}
