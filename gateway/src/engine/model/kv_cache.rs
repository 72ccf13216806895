//! Per-sequence key/value cache: one entry per layer.
//!
//! Plain layers keep every position; sliding-window layers keep only the last
//! `window - 1` positions between steps (a rotating cache in effect), which is
//! all a future query can attend to. The arrays and offsets are plain data so
//! a cache can be exported and imported (prompt caches build on this).
//!
//! A layer lives in one of two forms. MLX steps (prefill, adapters) hold MLX
//! arrays and grow them by concatenation. The native decode step moves the
//! layer into [`NativeLayer`] storage with spare capacity and writes each new
//! position in place; MLX sees that storage through views when it needs it.

use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use super::weights::MlxResult;
use crate::engine::distributed::lockstep::CacheTicket;
use crate::mlx::kernels;

/// One layer's cached keys and values, `[1, kv_heads, positions, head_dim]`.
#[derive(Clone, Default)]
pub struct LayerCache {
    /// MLX-held keys and values; `None` while the layer lives in `native`.
    pub keys: Option<Array>,
    pub values: Option<Array>,
    native: Option<NativeLayer>,
    /// Keep at most this many positions after a step (sliding layers).
    pub window: Option<usize>,
    /// Absolute position of the first cached entry.
    pub start: usize,
}

impl LayerCache {
    /// A layer holding `keys` and `values` (`[1, kv_heads, positions, head_dim]`).
    pub fn from_arrays(
        keys: Array,
        values: Array,
        window: Option<usize>,
        start: usize,
    ) -> LayerCache {
        LayerCache {
            keys: Some(keys),
            values: Some(values),
            native: None,
            window,
            start,
        }
    }

    /// Positions currently held.
    pub fn len(&self) -> usize {
        match &self.native {
            Some(native) => native.len,
            None => self.keys.as_ref().map_or(0, |k| k.shape()[2] as usize),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of keys and values held.
    pub fn nbytes(&self) -> usize {
        match &self.native {
            Some(native) => 2 * native.len * native.store.floats_per_slot() * 4,
            None => self
                .keys
                .iter()
                .chain(self.values.iter())
                .map(Array::nbytes)
                .sum(),
        }
    }

    /// Keys and values as MLX arrays, `[1, kv_heads, positions, head_dim]`:
    /// the held arrays, or views of native storage.
    pub fn mlx_arrays(&self) -> MlxResult<Option<(Array, Array)>> {
        match (&self.native, &self.keys, &self.values) {
            (Some(native), _, _) => native.views().map(Some),
            (None, Some(keys), Some(values)) => Ok(Some((keys.clone(), values.clone()))),
            _ => Ok(None),
        }
    }

    /// Moves a natively stored layer back to MLX arrays (views, no copy).
    fn move_to_mlx(&mut self) -> MlxResult<()> {
        if let Some(native) = self.native.take() {
            let (keys, values) = native.views()?;
            self.keys = Some(keys);
            self.values = Some(values);
        }
        Ok(())
    }

    /// Appends this step's keys/values; returns everything to attend over.
    pub fn append(&mut self, keys: Array, values: Array) -> MlxResult<(Array, Array)> {
        self.move_to_mlx()?;
        let (keys, values) = match (self.keys.take(), self.values.take()) {
            (Some(old_k), Some(old_v)) => (
                concatenate(&[old_k, keys], 2)?,
                concatenate(&[old_v, values], 2)?,
            ),
            _ => (keys, values),
        };
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        Ok((keys, values))
    }

    /// Drops positions no later query can see (sliding layers only).
    pub fn trim(&mut self) -> MlxResult<()> {
        let Some(window) = self.window else {
            return Ok(());
        };
        let keep = window.saturating_sub(1);
        let len = self.len();
        if len <= keep {
            return Ok(());
        }
        let cut = (len - keep) as i32;
        if let Some(native) = &mut self.native {
            native.first += cut as usize;
            native.len -= cut as usize;
        } else if let (Some(keys), Some(values)) = (&self.keys, &self.values) {
            self.keys = Some(keys.index((.., .., cut.., ..)));
            self.values = Some(values.index((.., .., cut.., ..)));
        }
        self.start += cut as usize;
        Ok(())
    }

    /// This layer cut back to its first `len` positions.
    fn truncate(&mut self, len: usize) {
        if let Some(native) = &mut self.native {
            native.len = native.len.min(len);
            return;
        }
        let end = len as i32;
        self.keys = self.keys.take().map(|k| k.index((.., .., ..end, ..)));
        self.values = self.values.take().map(|v| v.index((.., .., ..end, ..)));
    }

    /// Appends one position's keys and values (`[kv_heads, head_dim]` each)
    /// in native storage, moving the layer there first (one copy) when it is
    /// held by MLX, full, or shared with a cache that has grown past it.
    pub fn push_native(
        &mut self,
        keys: &[f32],
        values: &[f32],
        kv_heads: usize,
        head_dim: usize,
    ) -> MlxResult<()> {
        let slot = match &self.native {
            Some(native) => native.claim_next(),
            None => None,
        };
        let slot = match slot {
            Some(slot) => slot,
            None => {
                let native = self.move_to_native(kv_heads, head_dim)?;
                let slot = native.first + native.len;
                native.store.claimed.store(slot + 1, Ordering::Release);
                slot
            }
        };
        let native = self.native.as_mut().expect("moved to native storage above");
        // SAFETY: `slot` was claimed by this layer alone and lies inside the
        // store, whose buffers hold `kv_heads * head_dim` floats per slot.
        unsafe { native.store.write(slot, keys, values) };
        native.len += 1;
        Ok(())
    }

    /// Attention of one query position (`q`, `[heads, head_dim]`) over every
    /// position held natively, into `out`: one row of a batched call
    /// ([`kernels::decode_attention_many`]).
    ///
    /// # Safety
    /// `out` and `q` must outlive the row's use, `out` untouched meanwhile,
    /// and this layer must not be written or dropped until the call is done.
    pub unsafe fn attention_row(&self, out: &mut [f32], q: &[f32]) -> kernels::AttentionRow {
        let native = self
            .native
            .as_ref()
            .expect("attention_row follows push_native");
        let store = &native.store;
        let offset = native.first * store.head_dim;
        // SAFETY: positions [first, first + len) of every kv head lie inside
        // the buffers and are claimed, so no other cache writes them; the
        // caller keeps them alive.
        unsafe {
            kernels::AttentionRow::new(
                out,
                q,
                store.keys_ptr().add(offset),
                store.values_ptr().add(offset),
                native.len,
                store.capacity * store.head_dim,
            )
        }
    }

    /// Fresh native storage holding this layer's positions with room to grow.
    fn move_to_native(&mut self, kv_heads: usize, head_dim: usize) -> MlxResult<&mut NativeLayer> {
        let len = self.len();
        // Double as it grows; a sliding layer's positions are bounded, so
        // room for its window plus some slack means a copy every few hundred
        // steps at most.
        let mut capacity = (2 * len).max(len + 256);
        if let Some(window) = self.window {
            capacity = capacity.min(window + 256).max(len + 1);
        }
        let store = KvStore::new(kv_heads, head_dim, capacity);
        if let Some(old) = &self.native {
            // SAFETY: both ranges are in bounds; old positions are claimed.
            unsafe { store.copy_from(&old.store, old.first, len) };
        } else if let (Some(keys), Some(values)) = (&self.keys, &self.values) {
            store.fill_from_mlx(keys, values, len)?;
        }
        self.keys = None;
        self.values = None;
        Ok(self.native.insert(NativeLayer {
            store: Arc::new(store),
            first: 0,
            len,
        }))
    }
}

/// A layer's keys and values in storage that the native decode step appends
/// to in place: slots `[first, first + len)` of `store`.
#[derive(Clone)]
struct NativeLayer {
    store: Arc<KvStore>,
    first: usize,
    len: usize,
}

impl NativeLayer {
    /// Claims the slot after this layer's last one, if it is free: not past
    /// the capacity, and not already written by another cache sharing the
    /// store (a clone, or the longer cache this one was truncated from).
    fn claim_next(&self) -> Option<usize> {
        let slot = self.first + self.len;
        (slot < self.store.capacity
            && self
                .store
                .claimed
                .compare_exchange(slot, slot + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok())
        .then_some(slot)
    }

    /// MLX views of the held positions, `[1, kv_heads, len, head_dim]`.
    fn views(&self) -> MlxResult<(Array, Array)> {
        let range = self.first as i32..(self.first + self.len) as i32;
        let keys = self.store.wrap(self.store.keys_ptr())?;
        let values = self.store.wrap(self.store.values_ptr())?;
        Ok((
            keys.index((.., .., range.clone(), ..)),
            values.index((.., .., range, ..)),
        ))
    }
}

/// Keys and values of one layer, `[kv_heads, capacity, head_dim]` f32 each.
///
/// Slots are written once: a writer first claims the slot right after the
/// highest claimed one (`claimed`), so every cache sharing the store, and
/// every MLX view of it, only ever reads slots that no one writes again.
struct KvStore {
    keys: ZeroedFloats,
    values: ZeroedFloats,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    /// Slots `[0, claimed)` are written or being written by their claimant.
    claimed: AtomicUsize,
}

/// Zeroed f32 storage from the system allocator, whose fresh pages come
/// zero from the kernel: nothing passes over a store until it is written.
/// (The process allocator, mimalloc, zeroed each new store itself: ~2.8 ms
/// per layer for a short prompt's cache, ~0.17 s per new sequence's first
/// decode step, stalling every stream in its batch.)
struct ZeroedFloats {
    ptr: std::ptr::NonNull<UnsafeCell<f32>>,
    layout: std::alloc::Layout,
}

impl ZeroedFloats {
    fn new(floats: usize) -> ZeroedFloats {
        let layout = std::alloc::Layout::array::<f32>(floats.max(1))
            .expect("a KV store of this size fits the address space");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::GlobalAlloc::alloc_zeroed(&std::alloc::System, layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw.cast::<UnsafeCell<f32>>()) else {
            std::alloc::handle_alloc_error(layout);
        };
        ZeroedFloats { ptr, layout }
    }

    fn ptr(&self) -> *mut f32 {
        UnsafeCell::raw_get(self.ptr.as_ptr())
    }
}

impl Drop for ZeroedFloats {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` by the same allocator with `layout`.
        unsafe {
            std::alloc::GlobalAlloc::dealloc(
                &std::alloc::System,
                self.ptr.as_ptr().cast(),
                self.layout,
            )
        };
    }
}

// SAFETY: slots are written only by the one cache that claimed them (see
// `claimed`), before any reader is given a length that covers them.
unsafe impl Send for KvStore {}
unsafe impl Sync for KvStore {}

impl KvStore {
    fn new(kv_heads: usize, head_dim: usize, capacity: usize) -> KvStore {
        let floats = kv_heads * capacity * head_dim;
        // Zeroed by the allocator (fresh pages come zeroed, no pass over
        // them): building the cells one by one took ~20 ns each, 0.7 s
        // for a 2,000-token prompt's first decode step.
        KvStore {
            keys: ZeroedFloats::new(floats),
            values: ZeroedFloats::new(floats),
            kv_heads,
            head_dim,
            capacity,
            claimed: AtomicUsize::new(0),
        }
    }

    fn floats_per_slot(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    fn keys_ptr(&self) -> *mut f32 {
        self.keys.ptr()
    }

    fn values_ptr(&self) -> *mut f32 {
        self.values.ptr()
    }

    /// Writes one slot's keys and values (`[kv_heads, head_dim]` each).
    ///
    /// # Safety
    /// The caller has claimed `slot`, which is below the capacity.
    unsafe fn write(&self, slot: usize, keys: &[f32], values: &[f32]) {
        let d = self.head_dim;
        assert!(slot < self.capacity && keys.len() == self.floats_per_slot());
        assert_eq!(values.len(), keys.len());
        for head in 0..self.kv_heads {
            let at = (head * self.capacity + slot) * d;
            // SAFETY: in bounds (checked above); the slot is ours alone.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    keys[head * d..].as_ptr(),
                    self.keys_ptr().add(at),
                    d,
                );
                std::ptr::copy_nonoverlapping(
                    values[head * d..].as_ptr(),
                    self.values_ptr().add(at),
                    d,
                );
            }
        }
    }

    /// Copies `len` positions from slot `first` of `old` to slot 0 here.
    ///
    /// # Safety
    /// The positions are claimed in `old` and `len` fits here.
    unsafe fn copy_from(&self, old: &KvStore, first: usize, len: usize) {
        let d = self.head_dim;
        assert!(len <= self.capacity && first + len <= old.capacity);
        for head in 0..self.kv_heads {
            let from = (head * old.capacity + first) * d;
            let to = head * self.capacity * d;
            // SAFETY: both ranges are in bounds; `self` is not yet shared.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    old.keys_ptr().add(from),
                    self.keys_ptr().add(to),
                    len * d,
                );
                std::ptr::copy_nonoverlapping(
                    old.values_ptr().add(from),
                    self.values_ptr().add(to),
                    len * d,
                );
            }
        }
        self.claimed.store(len, Ordering::Release);
    }

    /// Copies MLX-held keys and values (`[1, kv_heads, len, head_dim]`) in.
    fn fill_from_mlx(&self, keys: &Array, values: &Array, len: usize) -> MlxResult<()> {
        let d = self.head_dim;
        for (array, base) in [(keys, self.keys_ptr()), (values, self.values_ptr())] {
            let packed = array.as_dtype(Dtype::Float32)?.contiguous()?;
            packed.eval()?;
            let data = packed.as_slice::<f32>();
            assert_eq!(data.len(), self.kv_heads * len * d);
            for head in 0..self.kv_heads {
                let from = &data[head * len * d..(head + 1) * len * d];
                // SAFETY: in bounds (`len` fits the capacity); `self` is not
                // yet shared.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        from.as_ptr(),
                        base.add(head * self.capacity * d),
                        len * d,
                    )
                };
            }
        }
        self.claimed.store(len, Ordering::Release);
        Ok(())
    }

    /// The whole buffer at `data` as an MLX array `[1, kv_heads, capacity,
    /// head_dim]` that keeps this store alive (MLX copies instead where its
    /// allocator cannot wrap foreign memory).
    fn wrap(self: &Arc<Self>, data: *mut f32) -> MlxResult<Array> {
        unsafe extern "C" fn release(payload: *mut c_void) {
            // SAFETY: `payload` is the Box<Arc<KvStore>> leaked below.
            drop(unsafe { Box::from_raw(payload as *mut Arc<KvStore>) });
        }
        let shape = [
            1,
            self.kv_heads as i32,
            self.capacity as i32,
            self.head_dim as i32,
        ];
        let payload = Box::into_raw(Box::new(Arc::clone(self))) as *mut c_void;
        // SAFETY: `data` is one of this store's buffers, alive until MLX
        // calls `release`; MLX reads only the slots views cover, which are
        // claimed and so never written again.
        let raw = unsafe {
            mlx_sys::mlx_array_new_data_managed_payload(
                data as *mut c_void,
                shape.as_ptr(),
                shape.len() as i32,
                mlx_sys::mlx_dtype__MLX_FLOAT32,
                payload,
                Some(release),
            )
        };
        if raw.ctx.is_null() {
            // SAFETY: MLX did not take the payload.
            unsafe { release(payload) };
            return Err(mlx_rs::error::Exception::custom(
                "MLX could not create an array over the key/value cache",
            ));
        }
        // SAFETY: a fresh, owned mlx_array.
        Ok(unsafe { Array::from_ptr(raw) })
    }
}

/// Every layer's keys and values of a batch decoding together on a GPU,
/// as of its last step (`epoch`): `[rows, kv_heads, columns, head_dim]` per
/// layer. The caches in that step read their rows here. A step takes the
/// arrays out while it runs, so that the slab's only holder is MLX's graph
/// and the new position is written in place (MLX donates a buffer nobody
/// else holds; or the attention kernel writes it: `transformer::slab`)
/// instead of copying the whole slab, then puts the new ones back. Shared
/// by `Rc`: caches, like MLX arrays, stay on their engine's thread.
#[derive(Default)]
pub struct SlabArrays {
    pub layers: std::cell::RefCell<Vec<(Array, Array)>>,
    pub epoch: std::cell::Cell<u64>,
}

/// Where a cache's positions live while it decodes in a GPU batch: row
/// `row`, columns `start..end` of every layer of `slab`, valid while the
/// slab is at `epoch`. Once a step goes on without this cache (the row
/// may then be reused or moved), its positions are in `lease`.
#[derive(Clone)]
pub struct SlabRow {
    pub slab: std::rc::Rc<SlabArrays>,
    pub row: usize,
    pub start: usize,
    pub end: usize,
    pub epoch: u64,
    pub lease: std::rc::Rc<RowLease>,
}

/// A slab row's tie to the caches it belongs to (shared with the slab): a
/// step that finds the row unclaimed while a cache still holds the lease
/// leaves a copy of the row's positions here, `[1, kv_heads, positions,
/// head_dim]` per layer, before the row is reused.
#[derive(Default)]
pub struct RowLease {
    pub copy: std::cell::RefCell<Option<Vec<(Array, Array)>>>,
}

/// The cache of one sequence across all layers.
#[derive(Clone, Default)]
pub struct KvCache {
    pub layers: Vec<LayerCache>,
    /// Tokens processed so far (the next token's absolute position).
    pub offset: usize,
    /// Set while the positions live in a GPU batch's slab instead of
    /// `layers` (see `transformer::slab`); [`KvCache::settle`] moves them back.
    pub slab: Option<SlabRow>,
    /// On rank 0 of a served process group: the id the workers keep their
    /// part of this cache under, until the last copy of the ticket drops.
    pub ticket: Option<Arc<CacheTicket>>,
}

impl KvCache {
    pub fn new(windows: impl IntoIterator<Item = Option<usize>>) -> KvCache {
        KvCache {
            layers: windows
                .into_iter()
                .map(|window| LayerCache {
                    window,
                    ..LayerCache::default()
                })
                .collect(),
            offset: 0,
            slab: None,
            ticket: None,
        }
    }

    /// Moves positions held in a batch's slab into the layers, as views of
    /// the slab (no copy). Every reader of `layers` calls it first. Fails
    /// when those positions were lost with a failed step.
    pub fn settle(&mut self) -> MlxResult<()> {
        let Some(at) = self.slab.take() else {
            return Ok(());
        };
        if let Some(copy) = at.lease.copy.borrow().as_ref() {
            for (layer, (keys, values)) in self.layers.iter_mut().zip(copy) {
                layer.keys = Some(keys.clone());
                layer.values = Some(values.clone());
                layer.native = None;
                layer.start = 0;
            }
            return Ok(());
        }
        let slab = at.slab.layers.borrow();
        if at.epoch != at.slab.epoch.get() || slab.len() != self.layers.len() {
            return Err(mlx_rs::error::Exception::custom(
                "this sequence's keys and values were lost with a failed decode step",
            ));
        }
        let (row, start, end) = (at.row as i32, at.start as i32, at.end as i32);
        for (layer, (keys, values)) in self.layers.iter_mut().zip(slab.iter()) {
            let view = |all: &Array| all.index((row..row + 1, .., start..end, ..));
            layer.keys = Some(view(keys));
            layer.values = Some(view(values));
            layer.native = None;
            layer.start = 0;
        }
        Ok(())
    }

    /// This cache with its positions in its own layers: [`KvCache::settle`]
    /// on a copy when they are in a slab.
    pub fn settled(&self) -> MlxResult<std::borrow::Cow<'_, KvCache>> {
        if self.slab.is_none() {
            return Ok(std::borrow::Cow::Borrowed(self));
        }
        let mut own = self.clone();
        own.settle()?;
        Ok(std::borrow::Cow::Owned(own))
    }

    /// This cache in buffers of its own, for keeping after its sequence
    /// ends: a view of a batch's slab would keep the whole slab alive.
    pub fn detached(&self) -> MlxResult<KvCache> {
        if self.slab.is_none() {
            return Ok(self.clone());
        }
        let mut own = self.clone();
        own.settle()?;
        for layer in &mut own.layers {
            for array in [&mut layer.keys, &mut layer.values].into_iter().flatten() {
                *array = array.contiguous()?;
            }
        }
        // Evaluated now: a pending copy would hold the whole slab until then.
        mlx_rs::transforms::eval(own.arrays())?;
        Ok(own)
    }

    /// MLX-held arrays to evaluate with the step's output, so the graph
    /// stays short (natively stored layers, and a slab the step evaluates
    /// itself, have nothing pending).
    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.layers
            .iter()
            .flat_map(|layer| layer.keys.iter().chain(layer.values.iter()))
    }

    /// Bytes held by the cache (its rows' share of a slab).
    pub fn nbytes(&self) -> usize {
        match &self.slab {
            Some(slab) => slab
                .slab
                .layers
                .borrow()
                .iter()
                .map(|(k, v)| {
                    let per_column =
                        (k.nbytes() + v.nbytes()) / (k.shape()[0] * k.shape()[2]).max(1) as usize;
                    per_column * (slab.end - slab.start)
                })
                .sum(),
            None => self.layers.iter().map(LayerCache::nbytes).sum(),
        }
    }

    /// The longest prefix, of at most `tokens`, that [`KvCache::truncated`]
    /// can serve. A sliding-window layer that has dropped its oldest entries
    /// can only be reused whole: what a shorter prefix needs is gone.
    pub fn reusable(&self, tokens: usize) -> usize {
        let tokens = tokens.min(self.offset);
        let rotated = self.layers.iter().any(|l| l.start > 0);
        if rotated && tokens != self.offset {
            0
        } else {
            tokens
        }
    }

    /// This cache cut back to its first `tokens` positions (views, no copy).
    /// `tokens` must come from [`KvCache::reusable`].
    pub fn truncated(&self, tokens: usize) -> MlxResult<KvCache> {
        debug_assert_eq!(self.reusable(tokens), tokens);
        let this = self.settled()?;
        let mut layers = Vec::with_capacity(this.layers.len());
        for layer in &this.layers {
            let mut layer = layer.clone();
            if tokens < self.offset {
                layer.truncate(tokens - layer.start);
                layer.trim()?;
            }
            layers.push(layer);
        }
        // A copy holds no ticket: the workers of a served group have no
        // copy of their part (prompt reuse is off there).
        Ok(KvCache {
            layers,
            offset: tokens,
            slab: None,
            ticket: None,
        })
    }

    /// This cache as it was when it covered `tokens` positions, after a
    /// decode step that failed part way (some layers may hold one more
    /// position, views, no copy). `None` when a layer no longer holds what
    /// the next step needs (a sliding layer trimmed by the failed step).
    pub fn rewound(&self, tokens: usize) -> Option<KvCache> {
        let this = self.settled().ok()?;
        let mut layers = Vec::with_capacity(this.layers.len());
        for layer in &this.layers {
            // What a layer holds between steps: every position, or the
            // window's last `window - 1` for a sliding layer.
            let held = layer
                .window
                .map_or(tokens, |w| w.saturating_sub(1).min(tokens));
            if layer.start != tokens - held || layer.start + layer.len() < tokens {
                return None;
            }
            let mut layer = layer.clone();
            layer.truncate(held);
            layers.push(layer);
        }
        Some(KvCache {
            layers,
            offset: tokens,
            slab: None,
            ticket: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADS: usize = 2;
    const DIM: usize = 3;

    /// The keys and values a position holds in these tests: distinct per
    /// position, head and lane, values negated.
    fn entry(position: usize) -> (Vec<f32>, Vec<f32>) {
        let keys: Vec<f32> = (0..HEADS * DIM)
            .map(|i| (position * 100 + i) as f32)
            .collect();
        let values = keys.iter().map(|k| -k).collect();
        (keys, values)
    }

    /// `[1, HEADS, positions, DIM]` arrays of `entry` for `positions`.
    fn arrays(positions: std::ops::Range<usize>) -> (Array, Array) {
        let n = positions.len();
        let (mut keys, mut values) = (vec![0.0; HEADS * n * DIM], vec![0.0; HEADS * n * DIM]);
        for (slot, position) in positions.enumerate() {
            let (k, v) = entry(position);
            for head in 0..HEADS {
                let at = (head * n + slot) * DIM;
                keys[at..at + DIM].copy_from_slice(&k[head * DIM..(head + 1) * DIM]);
                values[at..at + DIM].copy_from_slice(&v[head * DIM..(head + 1) * DIM]);
            }
        }
        let shape = [1, HEADS as i32, n as i32, DIM as i32];
        (
            Array::from_slice(&keys, &shape),
            Array::from_slice(&values, &shape),
        )
    }

    fn push(layer: &mut LayerCache, position: usize) {
        let (k, v) = entry(position);
        layer.push_native(&k, &v, HEADS, DIM).expect("push");
        layer.trim().expect("trim");
    }

    /// The layer holds exactly `positions`, as MLX sees it.
    fn assert_holds(layer: &LayerCache, positions: std::ops::Range<usize>) {
        let (keys, values) = layer.mlx_arrays().expect("views").expect("not empty");
        let (want_keys, want_values) = arrays(positions.clone());
        assert_eq!(keys.shape(), want_keys.shape(), "holding {positions:?}");
        let contiguous = |a: &Array| a.contiguous().unwrap().as_slice::<f32>().to_vec();
        assert_eq!(
            contiguous(&keys),
            contiguous(&want_keys),
            "keys of {positions:?}"
        );
        assert_eq!(
            contiguous(&values),
            contiguous(&want_values),
            "values of {positions:?}"
        );
        assert_eq!(layer.start, positions.start);
        assert_eq!(layer.len(), positions.len());
    }

    #[test]
    fn native_storage_continues_mlx_arrays_and_grows() {
        let (keys, values) = arrays(0..5);
        let mut layer = LayerCache::from_arrays(keys, values, None, 0);
        for position in 5..600 {
            push(&mut layer, position);
        }
        assert_holds(&layer, 0..600);
        // Back to MLX for a prefill step: the views continue where it was.
        let (k, v) = arrays(600..602);
        let (all_keys, _) = layer.append(k, v).expect("append");
        assert_eq!(all_keys.shape(), &[1, HEADS as i32, 602, DIM as i32]);
        push(&mut layer, 602);
        assert_holds(&layer, 0..603);
    }

    #[test]
    fn sliding_layers_keep_their_window_across_compactions() {
        let mut layer = LayerCache {
            window: Some(8),
            ..LayerCache::default()
        };
        for position in 0..1000 {
            push(&mut layer, position);
            let first = (position + 1).saturating_sub(7);
            assert_holds(&layer, first..position + 1);
        }
    }

    #[test]
    fn caches_sharing_storage_never_see_each_others_writes() {
        let mut cache = KvCache::new([None]);
        for position in 0..10 {
            push(&mut cache.layers[0], position);
        }
        cache.offset = 10;
        let mut clone = cache.clone();
        let mut shorter = cache.truncated(6).expect("truncate");
        // Each extends the shared storage differently; the first to write a
        // slot keeps writing in place, the others copy first.
        push(&mut clone.layers[0], 10);
        push(&mut shorter.layers[0], 6);
        push(&mut cache.layers[0], 10);
        let (mine, _) = entry(6);
        assert_holds(&clone.layers[0], 0..11);
        assert_holds(&cache.layers[0], 0..11);
        let (keys, _) = shorter.layers[0].mlx_arrays().unwrap().unwrap();
        let keys = keys.contiguous().unwrap();
        // Position 6 of the shorter cache holds what it pushed there.
        assert_eq!(&keys.as_slice::<f32>()[6 * DIM..7 * DIM], &mine[..DIM]);
        // And a view taken before a sibling wrote on is unchanged after.
        let (before, _) = cache.layers[0].mlx_arrays().unwrap().unwrap();
        let snapshot = before.contiguous().unwrap().as_slice::<f32>().to_vec();
        push(&mut clone.layers[0], 11);
        push(&mut cache.layers[0], 11);
        assert_eq!(
            before.contiguous().unwrap().as_slice::<f32>(),
            &snapshot[..]
        );
    }

    #[test]
    fn native_bytes_count_held_positions() {
        let mut layer = LayerCache::default();
        for position in 0..3 {
            push(&mut layer, position);
        }
        assert_eq!(layer.nbytes(), 2 * 3 * HEADS * DIM * 4);
    }
}
