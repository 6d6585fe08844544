//! The mapped copy: the model with its weights moved, page-aligned, into one external
//! data file, which ONNX Runtime maps instead of copying.
//!
//! A `.onnx` file keeps its weights inline (`raw_data`), and a session made from it
//! copies every one of them into memory of its own: ~160 ms and 100 MiB of private
//! memory for the 100 MiB demo MLP, on every load. The same model with its weights in
//! an external data file, each at an offset aligned to the mapping granularity, loads
//! in ~4 ms: ONNX Runtime maps the file and its kernels read the weights in place (no
//! prepacking), so they are page cache, resident once a run touches them, shared by
//! every session and dropped by the kernel when memory is short. Its outputs are those
//! of the ORT-format copy, bit for bit (`tests/weights.rs`).
//!
//! Making it needs no runtime: the protobuf is walked with the zero-copy reader, the
//! graph's skeleton is rewritten (a few KiB) and each weight's bytes go from file to
//! file in the kernel (`copy_file_range`), so the copy holds no private memory and
//! takes ~30-40 ms for 100 MiB in the page cache (weights stored as panels, below, are
//! rearranged through a 4 MiB buffer: 47-165 ms for the 100 MiB MLP). That makes
//! it cheap enough for the first load to make, and the one-time conversion to the ORT
//! format starts from it: measured on the 100 MiB MLP, it peaks at +160 MiB from it
//! instead of +260 MiB from the `.onnx`, and finishes sooner (426 instead of 646 ms).
//!
//! The copy is also where a MatMul whose right-hand side is a big weight gets that weight
//! stored as panels (`panels`), so that runs without prepacking never pack it by strides.
//! Such a copy holds a `PANELS` marker, and the prepacked copy of its model is made from
//! the `.onnx` instead (prepacking the original layout is faster still).
//!
//! A model whose weights are already external (a file over 2 GB must be) or that has
//! none worth moving has no mapped copy: it is loaded from its own files.

use std::{
    fs::File,
    io::{Seek, SeekFrom},
    path::{Path, PathBuf},
};

use crate::{
    onnx_file::ModelFile,
    panel_op,
    panels::{self, Plan},
    proto::{put_bytes_field, put_varint_field, Fields, RawFields, Value},
};

/// Offsets of the weights in the data file: ONNX Runtime maps a tensor only when its
/// offset is a multiple of the allocation granularity (the page size on Linux, 64 KiB
/// on Windows), and reads it into a buffer of its own otherwise.
pub(crate) const ALIGN: u64 = 64 << 10;
/// Smaller tensors (shapes, scales) stay in the graph: mapping them saves nothing.
const MIN_MOVED_BYTES: usize = 4096;
/// The data file's name, next to the copy's `model.onnx`.
pub(crate) const DATA_FILE: &str = "model.data";
/// An empty file beside the copy's `model.onnx` when some of its weights are panels.
const PANELS: &str = "PANELS";

/// Where a weight goes: its bytes as they are, or as the panels of a `(K, N)` matrix.
pub(crate) type Place<'a> = dyn FnMut(&[u8], Option<(usize, usize)>) -> Result<u64, String> + 'a;

/// A rewritten model and how many of its weights were stored as panels.
pub(crate) struct Rewritten {
    pub(crate) model: Vec<u8>,
    pub(crate) paneled: usize,
}

/// The mapped copy of `onnx` in `dir` (`dir/model.onnx` + `dir/model.data`), if made.
pub(crate) fn cached(dir: &Path) -> Option<PathBuf> {
    Some(dir.join("model.onnx")).filter(|p| p.is_file())
}

/// Whether `onnx` can have a mapped copy: its weights are inline.
pub(crate) fn possible(onnx: &Path) -> bool {
    ModelFile::read(onnx).is_ok_and(|m| m.external_locations.is_empty())
}

/// Whether the mapped copy `copy` (its `model.onnx`) has weights stored as panels.
pub(crate) fn has_panels(copy: &Path) -> bool {
    copy.with_file_name(PANELS).is_file()
}

/// Whether the mapped copy of `onnx`, once made, would have weights stored as panels
/// (read from the graph, not the weights).
pub(crate) fn would_have_panels(onnx: &Path) -> bool {
    paneled_share(onnx) > 0.0
}

/// The share of `onnx`'s weight bytes its mapped copy stores (or would store) as panels.
pub(crate) fn paneled_share(onnx: &Path) -> f64 {
    let Ok(file) = File::open(onnx) else { return 0.0 };
    // SAFETY: as in `copy`: read-only, dropped before returning.
    let Ok(map) = (unsafe { memmap2::Mmap::map(&file) }) else { return 0.0 };
    plan_of(&map).share()
}

/// What to store as panels in the model `buf` (ModelProto: graph = 7): nothing in a model
/// that does not import the default domain or already imports `panel_op::DOMAIN`, nor in
/// a graph the plan cannot read (panels are an optimisation; ONNX Runtime judges the
/// graph when it loads it).
fn plan_of(buf: &[u8]) -> Plan {
    if opset(buf, &["", "ai.onnx"]).is_none() || opset(buf, &[panel_op::DOMAIN]).is_some() {
        return Plan::default();
    }
    let graph = Fields::new(buf).find_map(|f| match f {
        Ok((7, Value::Bytes(graph))) => Some(graph),
        _ => None,
    });
    graph.and_then(|g| panels::plan(g).ok()).unwrap_or_default()
}

/// The mapped copy of `onnx` in `dir`, made now if it is not there yet (written beside
/// and renamed into place, so a reader never sees half of one). `Ok(None)`: the model
/// cannot have one (see the module's doc).
pub(crate) fn copy(onnx: &Path, dir: &Path) -> Result<Option<PathBuf>, String> {
    if let Some(made) = cached(dir) {
        return Ok(Some(made));
    }
    let file = File::open(onnx).map_err(|e| format!("cannot open {}: {e}", onnx.display()))?;
    // SAFETY: read-only, dropped before returning; model files are not rewritten in
    // place while the server reads them (as in `ModelFile::read`).
    let map =
        unsafe { memmap2::Mmap::map(&file) }.map_err(|e| format!("cannot map {}: {e}", onnx.display()))?;
    let parsed = ModelFile::parse(&map).map_err(|e| format!("{}: {e}", onnx.display()))?;
    if !parsed.external_locations.is_empty() {
        return Ok(None);
    }
    // A name of its own per attempt: a load and a preparation in this process may make
    // the same copy at once (the first rename wins, the other's copy is dropped).
    let tmp = crate::owners::tmp_path(dir);
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let written = write_copy(&file, &map, &tmp);
    match written {
        Ok(true) => {}
        Ok(false) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Ok(None);
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(format!("cannot make a mapped copy of {}: {e}", onnx.display()));
        }
    }
    if let Err(e) = std::fs::rename(&tmp, dir) {
        let _ = std::fs::remove_dir_all(&tmp);
        // Another process made it meanwhile: theirs is as good.
        return cached(dir)
            .map(Some)
            .ok_or_else(|| format!("cannot move the mapped copy to {}: {e}", dir.display()));
    }
    Ok(cached(dir))
}

/// Writes `tmp/model.onnx` and `tmp/model.data`; `false` when there was nothing to move.
fn write_copy(file: &File, map: &[u8], tmp: &Path) -> Result<bool, String> {
    let data_path = tmp.join(DATA_FILE);
    let mut data =
        File::create(&data_path).map_err(|e| format!("cannot create {}: {e}", data_path.display()))?;
    let mut end = 0u64;
    let mut place = |bytes: &[u8], paneled: Option<(usize, usize)>| -> Result<u64, String> {
        // Where `bytes` sit in the file: they are a slice of `map`, which maps it from 0.
        let from = (bytes.as_ptr() as usize).wrapping_sub(map.as_ptr() as usize) as u64;
        let at = end.next_multiple_of(ALIGN);
        // The gap is a hole (zeros); the bytes go from file to file in the kernel.
        data.seek(SeekFrom::Start(at)).map_err(|e| e.to_string())?;
        let len = bytes.len() as u64;
        if let Some((k, n)) = paneled {
            panels::write_panels(&mut data, bytes, k, n).map_err(|e| e.to_string())?;
        } else {
            let mut src = file;
            src.seek(SeekFrom::Start(from)).map_err(|e| e.to_string())?;
            let copied =
                std::io::copy(&mut std::io::Read::take(src, len), &mut data).map_err(|e| e.to_string())?;
            if copied != len {
                return Err(format!("the model file changed while it was copied ({copied} of {len} bytes)"));
            }
        }
        end = at + len;
        Ok(at)
    };
    let Some(rewritten) = rewrite(map, &mut place)? else { return Ok(false) };
    let model_path = tmp.join("model.onnx");
    std::fs::write(&model_path, rewritten.model)
        .map_err(|e| format!("cannot write {}: {e}", model_path.display()))?;
    if rewritten.paneled > 0 {
        let mark = tmp.join(PANELS);
        std::fs::write(&mark, b"").map_err(|e| format!("cannot write {}: {e}", mark.display()))?;
    }
    Ok(true)
}

/// The model `buf` with each main-graph initializer's inline `raw_data` of at least
/// `MIN_MOVED_BYTES` handed to `place` (which stores them and says at which offset of
/// the data file) and replaced by an external-data reference, and the MatMuls the graph's
/// `panels::Plan` names rewritten (their weights handed to `place` as panels);
/// every other field is copied as it was encoded. `None` when no tensor was moved. Field
/// numbers are those of `onnx/onnx.proto3`: ModelProto.graph = 7, GraphProto.node = 1,
/// GraphProto.initializer = 5.
pub(crate) fn rewrite(buf: &[u8], place: &mut Place<'_>) -> Result<Option<Rewritten>, String> {
    let mut out = Vec::new();
    let (mut moved, mut paneled) = (0usize, 0usize);
    let plan = plan_of(buf);
    for field in RawFields::new(buf) {
        match field? {
            (7, graph, _) => {
                let mut g = Vec::new();
                for field in RawFields::new(graph.bytes(7)?) {
                    match field? {
                        (1, node, raw) => match plan.rewrite_node(node.bytes(1)?)? {
                            Some(node) => put_bytes_field(&mut g, 1, &node),
                            None => g.extend_from_slice(raw),
                        },
                        (5, tensor, raw) => match external_tensor(tensor.bytes(5)?, place, &plan)? {
                            Some((t, as_panels)) => {
                                moved += 1;
                                paneled += usize::from(as_panels);
                                put_bytes_field(&mut g, 5, &t);
                            }
                            None => g.extend_from_slice(raw),
                        },
                        (_, _, raw) => g.extend_from_slice(raw),
                    }
                }
                put_bytes_field(&mut out, 7, &g);
            }
            (_, _, raw) => out.extend_from_slice(raw),
        }
    }
    if paneled > 0 {
        // The rewritten MatMuls' operator (OperatorSetIdProto: domain = 1, version = 2).
        let mut set = Vec::new();
        put_bytes_field(&mut set, 1, panel_op::DOMAIN.as_bytes());
        put_varint_field(&mut set, 2, panel_op::VERSION);
        put_bytes_field(&mut out, 8, &set);
    }
    Ok((moved > 0).then_some(Rewritten { model: out, paneled }))
}

/// The version of the first of `domains` the model `buf` imports (ModelProto.opset_import
/// = 8; OperatorSetIdProto domain = 1, version = 2).
fn opset(buf: &[u8], domains: &[&str]) -> Option<u64> {
    for field in Fields::new(buf) {
        let Ok((8, Value::Bytes(set))) = field else { continue };
        let (mut domain, mut version) = ("", None);
        for f in Fields::new(set) {
            match f {
                Ok((1, Value::Bytes(d))) => domain = std::str::from_utf8(d).unwrap_or("?"),
                Ok((2, Value::Varint(v))) => version = Some(v),
                _ => {}
            }
        }
        if domains.contains(&domain) {
            return version;
        }
    }
    None
}

/// A TensorProto whose `raw_data` (9) moved out: the same fields but that one, plus
/// `external_data` (13: location, offset, length) and `data_location` (14) = EXTERNAL;
/// for a weight `plan` names, its `dims` (1) those of its panels and its data rearranged
/// (`true`).
fn external_tensor(
    buf: &[u8],
    place: &mut Place<'_>,
    plan: &Plan,
) -> Result<Option<(Vec<u8>, bool)>, String> {
    let (mut raw_data, mut name) = (None, "");
    for field in RawFields::new(buf) {
        match field? {
            (9, Value::Bytes(b), _) => raw_data = Some(b),
            (8, v, _) => name = v.string(8)?,
            // Already external (or a location field set on an inline tensor): leave it.
            (13 | 14, _, _) => return Ok(None),
            _ => {}
        }
    }
    let Some(bytes) = raw_data.filter(|b| b.len() >= MIN_MOVED_BYTES) else { return Ok(None) };
    let paneled = plan.weight(name);
    let offset = place(bytes, paneled)?;
    let mut out = Vec::with_capacity(buf.len().min(4096) + 64);
    for field in RawFields::new(buf) {
        match field? {
            (9, _, _) => {}
            (1, _, _) if paneled.is_some() => {}
            (_, _, raw) => out.extend_from_slice(raw),
        }
    }
    if let Some((k, n)) = paneled {
        for dim in panels::stored_dims(k, n) {
            put_varint_field(&mut out, 1, dim as u64);
        }
    }
    for (key, value) in [
        ("location", DATA_FILE.to_owned()),
        ("offset", offset.to_string()),
        ("length", bytes.len().to_string()),
    ] {
        let mut entry = Vec::new();
        put_bytes_field(&mut entry, 1, key.as_bytes());
        put_bytes_field(&mut entry, 2, value.as_bytes());
        put_bytes_field(&mut out, 13, &entry);
    }
    put_varint_field(&mut out, 14, 1);
    Ok(Some((out, paneled.is_some())))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::proto::{bytes_field, varint_field, Fields};

    fn tensor(name: &str, raw: &[u8]) -> Vec<u8> {
        [varint_field(1, 4), varint_field(2, 1), bytes_field(8, name.as_bytes()), bytes_field(9, raw)]
            .concat()
    }

    fn fields(buf: &[u8]) -> Vec<(u32, Value<'_>)> {
        Fields::new(buf).map(Result::unwrap).collect()
    }

    /// A "data file" in memory, placing each tensor at the next aligned offset.
    fn sink(data: &mut Vec<u8>) -> impl FnMut(&[u8], Option<(usize, usize)>) -> Result<u64, String> + '_ {
        move |bytes, paneled| {
            let at = (data.len() as u64).next_multiple_of(ALIGN);
            data.resize(at as usize, 0);
            match paneled {
                Some((k, n)) => panels::write_panels(data, bytes, k, n).unwrap(),
                None => data.extend_from_slice(bytes),
            }
            Ok(at)
        }
    }

    #[test]
    fn big_initializers_move_to_aligned_offsets_and_everything_else_is_kept() {
        let (w1, w2, small) = (vec![1u8; 5000], vec![2u8; 70_000], vec![3u8; 16]);
        let graph = [
            bytes_field(1, b"node bytes"),
            bytes_field(5, &tensor("w1", &w1)),
            bytes_field(5, &tensor("small", &small)),
            bytes_field(5, &tensor("w2", &w2)),
            // A fixed32 field of an unknown extension: copied byte for byte.
            vec![0xfd, 0x07, 9, 9, 9, 9],
        ]
        .concat();
        let model = [varint_field(1, 8), bytes_field(7, &graph), bytes_field(14, b"metadata")].concat();
        let mut data = Vec::new();
        let out = rewrite(&model, &mut sink(&mut data)).unwrap().unwrap().model;
        assert!(out.len() < 400, "the weights left the graph: {} bytes", out.len());
        let top = fields(&out);
        assert_eq!(top[0], (1, Value::Varint(8)));
        assert_eq!(top[2], (14, Value::Bytes(b"metadata")));
        let Value::Bytes(g) = top[1].1 else { panic!() };
        let g = fields(g);
        assert_eq!(g[0], (1, Value::Bytes(b"node bytes")));
        assert_eq!(g[4], (127, Value::Fixed32));
        let Value::Bytes(small_out) = g[2].1 else { panic!() };
        assert_eq!(small_out, tensor("small", &small), "a small tensor stays inline, unchanged");
        for (i, want, offset) in [(1, &w1, 0u64), (3, &w2, ALIGN)] {
            let Value::Bytes(t) = g[i].1 else { panic!() };
            let t = fields(t);
            assert!(!t.iter().any(|(f, _)| *f == 9), "raw_data left");
            assert_eq!(t.last(), Some(&(14, Value::Varint(1))), "data_location = EXTERNAL");
            let entries: Vec<(String, String)> = t
                .iter()
                .filter(|(f, _)| *f == 13)
                .map(|(_, v)| {
                    let Value::Bytes(e) = v else { panic!() };
                    let e = fields(e);
                    let s = |v: &Value| match v {
                        Value::Bytes(b) => String::from_utf8(b.to_vec()).unwrap(),
                        _ => panic!(),
                    };
                    (s(&e[0].1), s(&e[1].1))
                })
                .collect();
            let (off, len) = (offset.to_string(), want.len().to_string());
            let expected = [("location", DATA_FILE), ("offset", off.as_str()), ("length", len.as_str())]
                .map(|(k, v)| (k.to_owned(), v.to_owned()));
            assert_eq!(entries, expected);
            assert_eq!(&data[offset as usize..offset as usize + want.len()], want.as_slice());
        }
    }

    #[test]
    fn a_model_with_nothing_to_move_or_external_weights_is_left_alone() {
        let small = [varint_field(1, 8), bytes_field(7, &bytes_field(5, &tensor("s", &[1; 8])))].concat();
        assert!(rewrite(&small, &mut sink(&mut Vec::new())).unwrap().is_none());
        let external = [tensor("w", &[0; 8192]), varint_field(14, 1)].concat();
        let model = [bytes_field(7, &bytes_field(5, &external))].concat();
        assert!(rewrite(&model, &mut sink(&mut Vec::new())).unwrap().is_none());
    }

    #[test]
    fn a_big_matmul_weight_is_written_as_panels_with_their_dims_and_its_node_rewritten() {
        // x [batch, 256] -> MatMul(x, W [256, 8192]) = y: W is 8 MiB with 8192 columns.
        let (k, n) = (256usize, 8192usize);
        let w: Vec<u8> = (0..(k * n) as u32).flat_map(|v| v.to_le_bytes()).collect();
        let weight = [
            varint_field(1, k as u64),
            varint_field(1, n as u64),
            varint_field(2, 1),
            bytes_field(8, b"W"),
            bytes_field(9, &w),
        ]
        .concat();
        let dim = bytes_field(1, &varint_field(1, 256));
        let x_type = [varint_field(1, 1), bytes_field(2, &[dim.clone(), dim].concat())].concat();
        let x = [bytes_field(1, b"x"), bytes_field(2, &bytes_field(1, &x_type))].concat();
        let matmul =
            [bytes_field(1, b"x"), bytes_field(1, b"W"), bytes_field(2, b"y"), bytes_field(4, b"MatMul")]
                .concat();
        let graph = [bytes_field(1, &matmul), bytes_field(5, &weight), bytes_field(11, &x)].concat();
        let mut data = Vec::new();
        let opset = bytes_field(8, &varint_field(2, 17));
        let ours = bytes_field(8, &[bytes_field(1, b"ai.snooze"), varint_field(2, 1)].concat());
        for (model, why) in [
            (bytes_field(7, &graph), "no default domain imported"),
            ([bytes_field(7, &graph), opset.clone(), ours.clone()].concat(), "ai.snooze imported already"),
        ] {
            let out = rewrite(&model, &mut sink(&mut Vec::new())).unwrap().unwrap();
            assert_eq!(out.paneled, 0, "{why}");
        }
        let out = rewrite(&[bytes_field(7, &graph), opset.clone()].concat(), &mut sink(&mut data))
            .unwrap()
            .unwrap();
        assert_eq!(out.paneled, 1);
        // The operator's domain is imported beside the model's own.
        let imports: Vec<_> = fields(&out.model).into_iter().filter(|(f, _)| *f == 8).collect();
        let [(8, Value::Bytes(default)), (8, Value::Bytes(added))] = imports[..] else {
            panic!("{imports:?}")
        };
        assert_eq!(default, &varint_field(2, 17)[..]);
        assert_eq!(added, &ours[2..], "ai.snooze, version 1");
        let top = fields(&out.model);
        let Value::Bytes(g) = top[0].1 else { panic!() };
        let ops: Vec<String> = fields(g)
            .iter()
            .filter(|(f, _)| *f == 1)
            .map(|(_, v)| {
                let Value::Bytes(node) = v else { panic!() };
                let op = fields(node).into_iter().find(|(f, _)| *f == 4).unwrap().1;
                let Value::Bytes(op) = op else { panic!() };
                String::from_utf8(op.to_vec()).unwrap()
            })
            .collect();
        assert_eq!(ops, ["PanelMatMul"]);
        let Value::Bytes(t) = fields(g).into_iter().find(|(f, _)| *f == 5).unwrap().1 else { panic!() };
        let dims: Vec<_> = fields(t).into_iter().filter(|(f, _)| *f == 1).map(|(_, v)| v).collect();
        let p = panels::PANEL;
        assert_eq!(dims, [n / p, k, p].map(|d| Value::Varint(d as u64)), "[N / PANEL, K, PANEL]");
        let stored: Vec<u32> =
            data[..k * n * 4].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        for (panel, row, col) in [(0, 0, 0), (0, 1, 0), (0, 0, 1), (n / p - 1, k - 1, p - 1), (211, 33, 7)] {
            let w = row * n + panel * p + col;
            assert_eq!(stored[(panel * k + row) * p + col], w as u32, "panel {panel} [{row}][{col}]");
        }
    }

    #[test]
    fn a_corrupt_model_is_an_error_and_a_failed_write_is_passed_on() {
        let cut = &bytes_field(7, &bytes_field(5, &tensor("w", &[0; 8192])))[..100];
        assert!(rewrite(cut, &mut sink(&mut Vec::new())).is_err());
        let model = bytes_field(7, &bytes_field(5, &tensor("w", &[0; 8192])));
        let err = rewrite(&model, &mut |_, _| Err("disk full".to_owned())).err().unwrap();
        assert_eq!(err, "disk full");
    }
}
