//! The key/value caches of every sequence a loaded Whisper model is decoding, laid out
//! so a decoder step over a batch copies nothing it does not have to.
//!
//! Per decoder layer there is one buffer of cross-attention keys (and one of values)
//! `[capacity, heads, audio_ctx, head_dim]` and one of self-attention keys (and values)
//! `[capacity, heads, width, head_dim]`. A sequence owns one *row* of each. The active
//! rows are always `0..n` (a freed row is filled by the last one), and a step's batch is
//! a contiguous range of rows, so the engine reads the cross and self caches of the
//! whole batch as one borrowed slice per layer: the 1500-position cross K/V (18 MiB a
//! sequence for tiny, 37 MiB for base) is written once per 30 s window and never copied
//! per step. When a step's sequences are not contiguous, rows are swapped first; the
//! scheduler usually batches the same jobs step after step, so that is rare.
//!
//! `width` is shared by all rows: the longest sequence rounded up to [`WIDTH_STEP`]
//! (at most the model's 448 positions). Shorter sequences' unused positions are masked
//! in the step. Widening (or narrowing, once the longest is well below the width)
//! re-lays the self caches out, a copy of at most a few MiB, a handful of times per window.
//!
//! A sequence is named by a [`SequenceId`]; a job holds it through a [`SequenceHandle`]
//! whose `Drop` frees the row. The handle refers to its store weakly: a model unloaded
//! and loaded again is a new store, and a job whose handle no longer points into the
//! model it runs on recomputes its cache there instead of failing.

use std::{
    ops::Range,
    sync::{Arc, Mutex, MutexGuard, PoisonError, Weak},
};

use super::engine::{CrossKv, DecoderOutput};

/// Self-cache positions are allocated in steps of this many.
pub const WIDTH_STEP: usize = 32;

/// The sizes a store is laid out by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    pub layers: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub audio_ctx: usize,
    pub text_ctx: usize,
}

impl CacheShape {
    fn cross_row(&self) -> usize {
        self.heads * self.audio_ctx * self.head_dim
    }

    fn self_row(&self, width: usize) -> usize {
        self.heads * width * self.head_dim
    }

    /// Bytes of `rows` sequences' caches at full width: what a store serving that many
    /// sequences at once may hold.
    pub fn bytes_for(&self, rows: usize) -> u64 {
        let per_row = 2 * self.layers * (self.cross_row() + self.self_row(self.text_ctx));
        (rows * per_row * std::mem::size_of::<f32>()) as u64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceId(u64);

#[derive(Debug, Clone, Copy)]
struct Slot {
    id: SequenceId,
    /// Cached positions.
    len: usize,
}

/// Four buffers per layer: cross keys, cross values, self keys, self values.
pub struct KvStore {
    shape: CacheShape,
    capacity: usize,
    width: usize,
    cross: [Vec<Vec<f32>>; 2],
    selfs: [Vec<Vec<f32>>; 2],
    rows: Vec<Slot>,
    next_id: u64,
}

impl KvStore {
    pub fn new(shape: CacheShape) -> KvStore {
        let empty = || vec![Vec::new(); shape.layers];
        KvStore {
            shape,
            capacity: 0,
            width: 0,
            cross: [empty(), empty()],
            selfs: [empty(), empty()],
            rows: Vec::new(),
            next_id: 0,
        }
    }

    /// Active sequences.
    pub fn sequences(&self) -> usize {
        self.rows.len()
    }

    /// Self-cache positions per row (the `n_past` of a step).
    pub fn width(&self) -> usize {
        self.width
    }

    /// Bytes the buffers hold now.
    pub fn bytes(&self) -> u64 {
        let per_row = 2 * self.shape.layers * (self.shape.cross_row() + self.shape.self_row(self.width));
        (self.capacity * per_row * std::mem::size_of::<f32>()) as u64
    }

    fn row_of(&self, id: SequenceId) -> Option<usize> {
        self.rows.iter().position(|s| s.id == id)
    }

    pub fn contains(&self, id: SequenceId) -> bool {
        self.row_of(id).is_some()
    }

    /// Cached positions of `id` (0 for an unknown id).
    pub fn len(&self, id: SequenceId) -> usize {
        self.row_of(id).map_or(0, |r| self.rows[r].len)
    }

    /// A new, empty sequence (its cross cache must be written before a step reads it).
    pub fn allocate(&mut self) -> SequenceId {
        if self.rows.len() == self.capacity {
            self.resize(self.capacity.max(1) * 2, self.width);
        }
        let id = SequenceId(self.next_id);
        self.next_id += 1;
        self.rows.push(Slot { id, len: 0 });
        id
    }

    /// A new sequence with a copy of `source`'s caches (the hypotheses of one window).
    pub fn fork(&mut self, source: SequenceId) -> Option<SequenceId> {
        self.row_of(source)?;
        let id = self.allocate();
        let (from, to) = (self.row_of(source)?, self.rows.len() - 1);
        self.copy_row(from, to);
        self.rows[to].len = self.rows[from].len;
        Some(id)
    }

    /// Frees `id`'s row; the last row moves into it so the active rows stay `0..n`.
    pub fn free(&mut self, id: SequenceId) {
        let Some(row) = self.row_of(id) else { return };
        let last = self.rows.len() - 1;
        if row != last {
            self.copy_row(last, row);
        }
        self.rows.swap_remove(row);
        if self.rows.is_empty() {
            // Nothing to keep: give the memory back until the next request.
            *self = KvStore { next_id: self.next_id, ..KvStore::new(self.shape) };
        }
    }

    /// Forgets positions from `len` on (a new window, or a retry at another temperature).
    pub fn truncate(&mut self, id: SequenceId, len: usize) {
        if let Some(row) = self.row_of(id) {
            self.rows[row].len = self.rows[row].len.min(len);
        }
    }

    /// Stores row `batch_row` of an encoder output as `id`'s cross cache.
    pub fn write_cross(&mut self, id: SequenceId, cross: &CrossKv, batch_row: usize) -> Result<(), String> {
        let row = self.row_of(id).ok_or("the sequence's cache has been freed")?;
        let n = self.shape.cross_row();
        for (buffers, outputs) in self.cross.iter_mut().zip([&cross.keys, &cross.values]) {
            if outputs.len() != self.shape.layers {
                return Err(format!(
                    "the encoder returned {} layers, not {}",
                    outputs.len(),
                    self.shape.layers
                ));
            }
            for (buffer, output) in buffers.iter_mut().zip(outputs) {
                let source =
                    output.get(batch_row * n..(batch_row + 1) * n).ok_or("the encoder output is short")?;
                buffer[row * n..(row + 1) * n].copy_from_slice(source);
            }
        }
        Ok(())
    }

    /// Makes room for `positions` cached positions (and every row's own): widens when
    /// needed, narrows when the longest sequence fell well below the width.
    pub fn fit_width(&mut self, positions: usize) {
        let positions = self.rows.iter().map(|s| s.len).fold(positions, usize::max);
        let wanted = positions.div_ceil(WIDTH_STEP).max(1) * WIDTH_STEP;
        let wanted = wanted.min(self.shape.text_ctx.max(positions));
        if wanted > self.width || wanted + 2 * WIDTH_STEP <= self.width {
            self.resize(self.capacity, wanted);
        }
    }

    /// Moves `ids` into contiguous rows and returns those rows and which id is in each
    /// (in row order). Rows already contiguous are not moved.
    pub fn arrange(&mut self, ids: &[SequenceId]) -> Result<(Range<usize>, Vec<SequenceId>), String> {
        let mut rows = Vec::with_capacity(ids.len());
        for &id in ids {
            rows.push(self.row_of(id).ok_or("a sequence's cache has been freed")?);
        }
        rows.sort_unstable();
        if rows.windows(2).any(|w| w[0] == w[1]) {
            return Err("a sequence appears twice in one step".into());
        }
        let k = rows.len();
        let Some(&first) = rows.first() else { return Ok((0..0, Vec::new())) };
        if rows[k - 1] - first + 1 != k {
            // Keep the window of k rows that already holds the most of them.
            let start = (0..=self.rows.len() - k)
                .max_by_key(|&s| (rows.iter().filter(|&&r| r >= s && r < s + k).count(), usize::MAX - s))
                .unwrap_or(0);
            let mut outside: Vec<usize> =
                rows.iter().copied().filter(|&r| r < start || r >= start + k).collect();
            for free in start..start + k {
                if !rows.contains(&free) {
                    if let Some(from) = outside.pop() {
                        self.swap_rows(from, free);
                    }
                }
            }
            rows = (start..start + k).collect();
        }
        let range = rows[0]..rows[0] + k;
        Ok((range.clone(), self.rows[range].iter().map(|s| s.id).collect()))
    }

    /// Appends row `batch_row`'s first `count` new keys and values of a decoder output
    /// (`[batch, heads, n_new, head_dim]` per layer) to `id`'s self cache.
    pub fn append(
        &mut self,
        id: SequenceId,
        output: &DecoderOutput,
        batch_row: usize,
        n_new: usize,
        count: usize,
    ) -> Result<(), String> {
        let row = self.row_of(id).ok_or("the sequence's cache has been freed")?;
        let len = self.rows[row].len;
        if len + count > self.width || count > n_new {
            return Err(format!("{count} new positions do not fit after {len} in a width of {}", self.width));
        }
        let (heads, hd, width) = (self.shape.heads, self.shape.head_dim, self.width);
        for (buffers, outputs) in self.selfs.iter_mut().zip([&output.new_keys, &output.new_values]) {
            for (buffer, new) in buffers.iter_mut().zip(outputs) {
                for h in 0..heads {
                    let src = ((batch_row * heads + h) * n_new) * hd;
                    let dst = ((row * heads + h) * width + len) * hd;
                    let source = new.get(src..src + count * hd).ok_or("the decoder output is short")?;
                    buffer[dst..dst + count * hd].copy_from_slice(source);
                }
            }
        }
        self.rows[row].len = len + count;
        Ok(())
    }

    /// Cross keys (`which` 0) or values (1) of `rows`, for one layer.
    pub fn cross(&self, which: usize, layer: usize, rows: &Range<usize>) -> &[f32] {
        let n = self.shape.cross_row();
        &self.cross[which][layer][rows.start * n..rows.end * n]
    }

    /// Self keys (`which` 0) or values (1) of `rows`, for one layer: `[rows, heads, width, head_dim]`.
    pub fn past(&self, which: usize, layer: usize, rows: &Range<usize>) -> &[f32] {
        let n = self.shape.self_row(self.width);
        &self.selfs[which][layer][rows.start * n..rows.end * n]
    }

    fn resize(&mut self, capacity: usize, width: usize) {
        let (shape, active, old_width) = (self.shape, self.rows.len(), self.width);
        let cross_row = shape.cross_row();
        for buffers in &mut self.cross {
            for buffer in buffers.iter_mut() {
                if capacity != self.capacity {
                    let mut grown = vec![0.0; capacity * cross_row];
                    grown[..active * cross_row].copy_from_slice(&buffer[..active * cross_row]);
                    *buffer = grown;
                }
            }
        }
        let keep = old_width.min(width);
        for buffers in &mut self.selfs {
            for buffer in buffers.iter_mut() {
                let mut laid = vec![0.0; capacity * shape.self_row(width)];
                for r in 0..active {
                    for h in 0..shape.heads {
                        let src = (r * shape.heads + h) * old_width * shape.head_dim;
                        let dst = (r * shape.heads + h) * width * shape.head_dim;
                        let n = keep * shape.head_dim;
                        laid[dst..dst + n].copy_from_slice(&buffer[src..src + n]);
                    }
                }
                *buffer = laid;
            }
        }
        for slot in &mut self.rows {
            slot.len = slot.len.min(width);
        }
        self.capacity = capacity;
        self.width = width;
    }

    fn copy_row(&mut self, from: usize, to: usize) {
        let cross_row = self.shape.cross_row();
        let self_row = self.shape.self_row(self.width);
        for (buffers, n) in
            self.cross.iter_mut().map(|b| (b, cross_row)).chain(self.selfs.iter_mut().map(|b| (b, self_row)))
        {
            for buffer in buffers.iter_mut() {
                buffer.copy_within(from * n..(from + 1) * n, to * n);
            }
        }
        self.rows[to].len = self.rows[from].len;
    }

    fn swap_rows(&mut self, a: usize, b: usize) {
        let (lo, hi) = (a.min(b), a.max(b));
        let cross_row = self.shape.cross_row();
        let self_row = self.shape.self_row(self.width);
        for (buffers, n) in
            self.cross.iter_mut().map(|b| (b, cross_row)).chain(self.selfs.iter_mut().map(|b| (b, self_row)))
        {
            for buffer in buffers.iter_mut() {
                let (head, tail) = buffer.split_at_mut(hi * n);
                head[lo * n..(lo + 1) * n].swap_with_slice(&mut tail[..n]);
            }
        }
        self.rows.swap(lo, hi);
    }
}

/// A store shared by a model and the handles of the jobs decoding on it.
pub struct SharedStore {
    store: Mutex<KvStore>,
    /// Rows whose handles were dropped while the store was locked: freed at the next lock.
    released: Mutex<Vec<SequenceId>>,
}

impl SharedStore {
    pub fn new(shape: CacheShape) -> Arc<SharedStore> {
        Arc::new(SharedStore { store: Mutex::new(KvStore::new(shape)), released: Mutex::new(Vec::new()) })
    }

    /// The store, with the rows of dropped handles freed.
    pub fn lock(&self) -> MutexGuard<'_, KvStore> {
        let mut store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        for id in std::mem::take(&mut *self.released.lock().unwrap_or_else(PoisonError::into_inner)) {
            store.free(id);
        }
        store
    }

    /// Bytes the caches hold now.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes()
    }
}

/// A job's claim on one sequence of a store; dropping it frees the row.
pub struct SequenceHandle {
    store: Weak<SharedStore>,
    id: SequenceId,
}

impl SequenceHandle {
    pub fn new(store: &Arc<SharedStore>, id: SequenceId) -> SequenceHandle {
        SequenceHandle { store: Arc::downgrade(store), id }
    }

    pub fn id(&self) -> SequenceId {
        self.id
    }

    /// Whether the row lives in `store` (false once the model it was made on is gone).
    pub fn belongs_to(&self, store: &Arc<SharedStore>) -> bool {
        Weak::ptr_eq(&self.store, &Arc::downgrade(store))
    }
}

impl std::fmt::Debug for SequenceHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SequenceHandle({:?})", self.id)
    }
}

impl Drop for SequenceHandle {
    fn drop(&mut self) {
        let Some(shared) = self.store.upgrade() else { return };
        // Never wait here: the dropping thread may be the one holding the store.
        let freed = match shared.store.try_lock() {
            Ok(mut store) => {
                store.free(self.id);
                true
            }
            Err(_) => false,
        };
        if !freed {
            shared.released.lock().unwrap_or_else(PoisonError::into_inner).push(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const SHAPE: CacheShape = CacheShape { layers: 2, heads: 2, head_dim: 3, audio_ctx: 4, text_ctx: 100 };

    /// An encoder output whose every value is `value`.
    fn cross(value: f32, batch: usize) -> CrossKv {
        let n = batch * SHAPE.heads * SHAPE.audio_ctx * SHAPE.head_dim;
        CrossKv { keys: vec![vec![value; n]; SHAPE.layers], values: vec![vec![-value; n]; SHAPE.layers] }
    }

    /// A decoder output of `n_new` positions whose keys are `value + position`.
    fn new_kv(value: f32, n_new: usize) -> DecoderOutput {
        let mut keys = Vec::new();
        for _ in 0..SHAPE.heads {
            for p in 0..n_new {
                keys.extend(std::iter::repeat_n(value + p as f32, SHAPE.head_dim));
            }
        }
        DecoderOutput {
            logits: vec![],
            new_keys: vec![keys.clone(); SHAPE.layers],
            new_values: vec![keys; SHAPE.layers],
        }
    }

    /// The first value of each of `id`'s cross rows and of its cached positions (head 0, layer 1).
    fn row(store: &KvStore, id: SequenceId) -> (f32, Vec<f32>) {
        let r = store.row_of(id).unwrap();
        let cross = store.cross(0, 1, &(r..r + 1))[0];
        let past = store.past(0, 1, &(r..r + 1));
        (cross, (0..store.len(id)).map(|p| past[p * SHAPE.head_dim]).collect())
    }

    #[test]
    fn rows_stay_compact_and_keep_their_data() {
        let mut store = KvStore::new(SHAPE);
        let ids: Vec<SequenceId> = (0..3).map(|_| store.allocate()).collect();
        store.fit_width(5);
        assert_eq!(store.width(), WIDTH_STEP);
        for (i, &id) in ids.iter().enumerate() {
            store.write_cross(id, &cross(i as f32 * 10.0, 3), i).unwrap();
            store.append(id, &new_kv(i as f32 * 10.0, 2), 0, 2, 2).unwrap();
        }
        assert_eq!(row(&store, ids[1]), (10.0, vec![10.0, 11.0]));
        // Freeing the first moves the last into its row.
        store.free(ids[0]);
        assert_eq!(store.sequences(), 2);
        assert_eq!(store.row_of(ids[2]), Some(0));
        assert_eq!(row(&store, ids[2]), (20.0, vec![20.0, 21.0]));
        // Widening keeps every cached position (up to the model's 100 positions here).
        store.fit_width(90);
        assert_eq!(store.width(), 3 * WIDTH_STEP);
        assert_eq!(row(&store, ids[1]), (10.0, vec![10.0, 11.0]));
        // A fork copies, a truncation forgets.
        let fork = store.fork(ids[1]).unwrap();
        store.truncate(ids[1], 1);
        assert_eq!(row(&store, fork), (10.0, vec![10.0, 11.0]));
        assert_eq!(row(&store, ids[1]), (10.0, vec![10.0]));
        // Narrowing happens once the longest row is well below the width.
        store.fit_width(3);
        assert_eq!(store.width(), WIDTH_STEP);
        assert_eq!(row(&store, fork), (10.0, vec![10.0, 11.0]));
        for id in [ids[1], ids[2], fork] {
            store.free(id);
        }
        assert_eq!((store.sequences(), store.bytes()), (0, 0), "an empty store gives its memory back");
    }

    #[test]
    fn a_step_gets_its_sequences_in_contiguous_rows() {
        let mut store = KvStore::new(SHAPE);
        let ids: Vec<SequenceId> = (0..5).map(|_| store.allocate()).collect();
        for (i, &id) in ids.iter().enumerate() {
            store.write_cross(id, &cross(i as f32, 1), 0).unwrap();
        }
        // Already contiguous: nothing moves; the order is the rows'.
        let (range, order) = store.arrange(&[ids[2], ids[1]]).unwrap();
        assert_eq!((range, order), (1..3, vec![ids[1], ids[2]]));
        // Rows 0, 2 and 4: one of them moves next to the others.
        let (range, order) = store.arrange(&[ids[0], ids[2], ids[4]]).unwrap();
        assert_eq!(range.len(), 3);
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, vec![ids[0], ids[2], ids[4]]);
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(row(&store, id).0, i as f32, "sequence {i} kept its cache through the swap");
        }
        assert!(store.arrange(&[ids[0], ids[0]]).is_err());
        store.free(ids[3]);
        assert!(store.arrange(&[ids[3]]).is_err());
    }

    #[test]
    fn planned_bytes_count_cross_and_self_caches() {
        // 2 layers x (keys + values) x (2 x 4 x 3 cross + 2 x 100 x 3 self) floats per row.
        assert_eq!(SHAPE.bytes_for(1), (2 * 2 * (24 + 600) * 4) as u64);
        let tiny = CacheShape { layers: 4, heads: 6, head_dim: 64, audio_ctx: 1500, text_ctx: 448 };
        assert_eq!(tiny.bytes_for(8) >> 20, 182);
    }
}
