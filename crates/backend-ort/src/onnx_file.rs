//! What an `.onnx` file declares, read without ONNX Runtime.
//!
//! The scheduler asks for a model's signature and footprint before it decides to
//! load it, so both must come from the file alone and cost nothing: the file is
//! memory-mapped and walked with the wire reader in `proto`, touching only the
//! graph's declarations and the initializers' names and external-data entries.
//! Field numbers are those of `onnx/onnx.proto3`.

use std::{
    collections::HashSet,
    fs::File,
    path::{Path, PathBuf},
};

use snooze_core::{DataType, ModelSignature, TensorSpec};

use crate::proto::Fields;

/// How deep subgraphs (If/Loop/Scan bodies) may nest before the file is called corrupt;
/// it bounds the recursion a hostile file could ask for.
const MAX_GRAPH_DEPTH: usize = 32;

/// What the walk found in a model file.
#[derive(Debug, Default)]
pub(crate) struct ModelFile {
    inputs: Vec<ValueInfo>,
    outputs: Vec<ValueInfo>,
    initializers: HashSet<String>,
    /// External-data files named by any tensor, relative to the model's folder, deduplicated.
    pub(crate) external_locations: Vec<String>,
    /// A node quantizes its input with a scale taken from the whole tensor, so one row's
    /// output depends on the other rows of its batch (an int8 export's
    /// `DynamicQuantizeLinear`).
    pub(crate) batch_dependent: bool,
}

/// Ops whose quantization scale is computed over their whole input, batch included.
const BATCH_DEPENDENT_OPS: [&str; 3] =
    ["DynamicQuantizeLinear", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM"];

#[derive(Debug)]
struct ValueInfo {
    name: String,
    kind: ValueKind,
}

#[derive(Debug)]
enum ValueKind {
    /// `shape` is `None` when the file does not give the rank.
    Tensor {
        elem_type: u64,
        shape: Option<Vec<i64>>,
    },
    Other(&'static str),
    Missing,
}

impl ModelFile {
    /// Maps `path` and walks it.
    pub(crate) fn read(path: &Path) -> Result<ModelFile, String> {
        let file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
        let len = file.metadata().map_err(|e| format!("cannot stat: {e}"))?.len();
        if len == 0 {
            return Err("the file is empty".to_owned());
        }
        // SAFETY: the map is read-only and dropped before returning. Another process
        // truncating the file meanwhile could fault the read; model files are not
        // rewritten in place while the server reads them.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| format!("cannot map: {e}"))?;
        ModelFile::parse(&map)
    }

    /// The external-data files this model, read from `onnx`, names: each once, in the
    /// order the graph first names them, beside the model file.
    pub(crate) fn external_files<'a>(&'a self, onnx: &Path) -> impl Iterator<Item = PathBuf> + 'a {
        let dir = onnx.parent().unwrap_or(Path::new(".")).to_path_buf();
        self.external_locations.iter().map(move |location| dir.join(location))
    }

    /// The value of the model's `metadata_props` entry `key` (ModelProto field 14:
    /// StringStringEntryProto key = 1, value = 2), without walking the graph.
    pub(crate) fn metadata(path: &Path, key: &str) -> Result<Option<String>, String> {
        let file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
        // SAFETY: as in `read`: a read-only map dropped before returning.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| format!("cannot map: {e}"))?;
        for field in Fields::new(&map) {
            if let (14, v) = field? {
                let (mut k, mut value) = (None, None);
                for entry in Fields::new(v.bytes(14)?) {
                    match entry? {
                        (1, e) => k = Some(e.bytes(1)?),
                        (2, e) => value = Some(e.bytes(2)?),
                        _ => {}
                    }
                }
                if k == Some(key.as_bytes()) {
                    let text = std::str::from_utf8(value.unwrap_or_default())
                        .map_err(|_| format!("metadata '{key}' is not UTF-8"))?;
                    return Ok(Some(text.to_owned()));
                }
            }
        }
        Ok(None)
    }

    pub(crate) fn parse(buf: &[u8]) -> Result<ModelFile, String> {
        let mut model = ModelFile::default();
        let mut locations = HashSet::new();
        let mut saw_graph = false;
        for field in Fields::new(buf) {
            match field? {
                (7, v) => {
                    saw_graph = true;
                    model.graph(v.bytes(7)?, true, 0, &mut locations)?;
                }
                // ModelProto.functions: their Constant nodes may hold external tensors.
                (25, v) => {
                    for field in Fields::new(v.bytes(25)?) {
                        if let (7, node) = field? {
                            model.node(node.bytes(7)?, 1, &mut locations)?;
                        }
                    }
                }
                _ => {}
            }
        }
        if !saw_graph {
            return Err("no graph in the file (is it an ONNX model?)".to_owned());
        }
        Ok(model)
    }

    fn graph(
        &mut self,
        buf: &[u8],
        main: bool,
        depth: usize,
        locations: &mut HashSet<String>,
    ) -> Result<(), String> {
        if depth > MAX_GRAPH_DEPTH {
            return Err(format!("subgraphs nested deeper than {MAX_GRAPH_DEPTH}"));
        }
        for field in Fields::new(buf) {
            match field? {
                (1, v) => self.node(v.bytes(1)?, depth, locations)?,
                (5, v) => self.tensor(v.bytes(5)?, main, locations)?,
                (15, v) => {
                    // SparseTensorProto: values = 1, indices = 2; the name is the values'.
                    for field in Fields::new(v.bytes(15)?) {
                        match field? {
                            (1, t) => self.tensor(t.bytes(1)?, main, locations)?,
                            (2, t) => self.tensor(t.bytes(2)?, false, locations)?,
                            _ => {}
                        }
                    }
                }
                (11, v) if main => self.inputs.push(value_info(v.bytes(11)?)?),
                (12, v) if main => self.outputs.push(value_info(v.bytes(12)?)?),
                _ => {}
            }
        }
        Ok(())
    }

    /// A node matters for its op (see `batch_dependent`) and for the tensors and subgraphs
    /// in its attributes.
    fn node(&mut self, buf: &[u8], depth: usize, locations: &mut HashSet<String>) -> Result<(), String> {
        for field in Fields::new(buf) {
            let attr = match field? {
                (4, op) => {
                    self.batch_dependent |= BATCH_DEPENDENT_OPS.contains(&op.string(4)?);
                    continue;
                }
                (5, attr) => attr,
                _ => continue,
            };
            for field in Fields::new(attr.bytes(5)?) {
                match field? {
                    (n @ (5 | 10), t) => self.tensor(t.bytes(n)?, false, locations)?,
                    (n @ (6 | 11), g) => self.graph(g.bytes(n)?, false, depth + 1, locations)?,
                    (n @ (22 | 23), s) => {
                        for field in Fields::new(s.bytes(n)?) {
                            if let (f @ (1 | 2), t) = field? {
                                self.tensor(t.bytes(f)?, false, locations)?;
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// Records a tensor's name (main-graph initializers only) and its external-data file.
    fn tensor(
        &mut self,
        buf: &[u8],
        initializer: bool,
        locations: &mut HashSet<String>,
    ) -> Result<(), String> {
        let mut name = None;
        let mut location = None;
        let mut external = false;
        for field in Fields::new(buf) {
            match field? {
                (8, v) => name = Some(v.string(8)?),
                (13, v) => {
                    let mut key = "";
                    let mut value = None;
                    for field in Fields::new(v.bytes(13)?) {
                        match field? {
                            (1, k) => key = k.string(1)?,
                            (2, val) => value = Some(val.string(2)?),
                            _ => {}
                        }
                    }
                    if key == "location" {
                        location = value;
                    }
                }
                (14, v) => external = v.varint(14)? == 1,
                _ => {}
            }
        }
        if initializer {
            if let Some(name) = name {
                self.initializers.insert(name.to_owned());
            }
        }
        if let (true, Some(location)) = (external, location) {
            if locations.insert(location.to_owned()) {
                self.external_locations.push(location.to_owned());
            }
        }
        Ok(())
    }

    /// The declared interface, in file order. Graph inputs that are initializers
    /// are overridable constants, not inputs a request must supply.
    pub(crate) fn signature(&self) -> Result<ModelSignature, String> {
        let inputs = self
            .inputs
            .iter()
            .filter(|v| !self.initializers.contains(&v.name))
            .map(|v| v.spec("input"))
            .collect::<Result<_, _>>()?;
        let outputs = self.outputs.iter().map(|v| v.spec("output")).collect::<Result<_, _>>()?;
        Ok(ModelSignature { platform: "onnxruntime_onnx".to_owned(), inputs, outputs })
    }
}

impl ValueInfo {
    fn spec(&self, role: &str) -> Result<TensorSpec, String> {
        let name = &self.name;
        match &self.kind {
            ValueKind::Tensor { elem_type, shape } => {
                let datatype = datatype(*elem_type).ok_or_else(|| {
                    format!(
                        "{role} '{name}' has ONNX element type {}, which KServe cannot carry \
                         (supported: BOOL, (U)INT8-64, FLOAT16, FLOAT, DOUBLE, STRING)",
                        onnx_type_name(*elem_type)
                    )
                })?;
                // An unknown rank has no faithful KServe form; the empty shape is the
                // closest, and every such tensor is then left to ONNX Runtime to check.
                Ok(TensorSpec { name: name.clone(), datatype, shape: shape.clone().unwrap_or_default() })
            }
            ValueKind::Other(kind) => {
                Err(format!("{role} '{name}' is a {kind}; only tensors can be served by the onnx backend"))
            }
            ValueKind::Missing => Err(format!("{role} '{name}' declares no type")),
        }
    }
}

/// A graph input's or value info's name and declared rank (`None`: not a tensor, or no
/// shape given).
pub(crate) fn declared_rank(buf: &[u8]) -> Result<(String, Option<usize>), String> {
    let info = value_info(buf)?;
    let rank = match info.kind {
        ValueKind::Tensor { shape: Some(dims), .. } => Some(dims.len()),
        _ => None,
    };
    Ok((info.name, rank))
}

fn value_info(buf: &[u8]) -> Result<ValueInfo, String> {
    let mut name = String::new();
    let mut kind = ValueKind::Missing;
    for field in Fields::new(buf) {
        match field? {
            (1, v) => name = v.string(1)?.to_owned(),
            (2, v) => kind = type_proto(v.bytes(2)?)?,
            _ => {}
        }
    }
    Ok(ValueInfo { name, kind })
}

fn type_proto(buf: &[u8]) -> Result<ValueKind, String> {
    let mut kind = ValueKind::Missing;
    for field in Fields::new(buf) {
        kind = match field? {
            (1, v) => tensor_type(v.bytes(1)?)?,
            (4, _) => ValueKind::Other("sequence"),
            (5, _) => ValueKind::Other("map"),
            (7, _) => ValueKind::Other("opaque value"),
            (8, _) => ValueKind::Other("sparse tensor"),
            (9, _) => ValueKind::Other("optional value"),
            _ => continue,
        };
    }
    Ok(kind)
}

fn tensor_type(buf: &[u8]) -> Result<ValueKind, String> {
    let mut elem_type = 0;
    let mut shape = None;
    for field in Fields::new(buf) {
        match field? {
            (1, v) => elem_type = v.varint(1)?,
            (2, v) => {
                let mut dims = Vec::new();
                for field in Fields::new(v.bytes(2)?) {
                    if let (1, dim) = field? {
                        dims.push(dimension(dim.bytes(1)?)?);
                    }
                }
                shape = Some(dims);
            }
            _ => {}
        }
    }
    Ok(ValueKind::Tensor { elem_type, shape })
}

/// A fixed size, or -1 for a symbolic (`dim_param`) or absent one.
fn dimension(buf: &[u8]) -> Result<i64, String> {
    let mut size = -1;
    for field in Fields::new(buf) {
        if let (1, v) = field? {
            // int64 on the wire: negative values are ten-byte two's complement.
            size = (v.varint(1)? as i64).max(-1);
        }
    }
    Ok(size)
}

/// ONNX `TensorProto.DataType` to the KServe datatype, where one exists.
fn datatype(elem_type: u64) -> Option<DataType> {
    Some(match elem_type {
        1 => DataType::Fp32,
        2 => DataType::Uint8,
        3 => DataType::Int8,
        4 => DataType::Uint16,
        5 => DataType::Int16,
        6 => DataType::Int32,
        7 => DataType::Int64,
        8 => DataType::Bytes,
        9 => DataType::Bool,
        10 => DataType::Fp16,
        11 => DataType::Fp64,
        12 => DataType::Uint32,
        13 => DataType::Uint64,
        _ => return None,
    })
}

fn onnx_type_name(elem_type: u64) -> String {
    let name = match elem_type {
        0 => "UNDEFINED",
        14 => "COMPLEX64",
        15 => "COMPLEX128",
        16 => "BFLOAT16",
        17 => "FLOAT8E4M3FN",
        18 => "FLOAT8E4M3FNUZ",
        19 => "FLOAT8E5M2",
        20 => "FLOAT8E5M2FNUZ",
        21 => "UINT4",
        22 => "INT4",
        23 => "FLOAT4E2M1",
        other => return format!("#{other}"),
    };
    name.to_owned()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::proto::{bytes_field as ld, varint_field as varint};

    fn tensor_value_info(name: &str, elem: u64, dims: &[Result<i64, &str>]) -> Vec<u8> {
        let dims: Vec<u8> = dims
            .iter()
            .flat_map(|d| match d {
                Ok(v) => ld(1, &varint(1, *v as u64)),
                Err(p) => ld(1, &ld(2, p.as_bytes())),
            })
            .collect();
        let tensor = [varint(1, elem), ld(2, &dims)].concat();
        [ld(1, name.as_bytes()), ld(2, &ld(1, &tensor))].concat()
    }

    fn external_tensor(name: &str, location: &str) -> Vec<u8> {
        let entry = [ld(1, b"location"), ld(2, location.as_bytes())].concat();
        [ld(8, name.as_bytes()), ld(13, &entry), varint(14, 1)].concat()
    }

    #[test]
    fn reads_inputs_outputs_and_skips_initializer_inputs() {
        let graph = [
            ld(5, &external_tensor("W", "w.bin")),
            ld(5, &external_tensor("B", "w.bin")),
            ld(11, &tensor_value_info("x", 1, &[Err("batch"), Ok(4)])),
            ld(11, &tensor_value_info("W", 1, &[Ok(4), Ok(4)])),
            ld(12, &tensor_value_info("y", 10, &[Ok(-7), Ok(4)])),
        ]
        .concat();
        let model = ModelFile::parse(&[varint(1, 8), ld(7, &graph)].concat()).unwrap();
        let sig = model.signature().unwrap();
        assert_eq!(sig.platform, "onnxruntime_onnx");
        assert_eq!(
            sig.inputs,
            vec![TensorSpec { name: "x".into(), datatype: DataType::Fp32, shape: vec![-1, 4] }]
        );
        assert_eq!(sig.outputs[0].datatype, DataType::Fp16);
        assert_eq!(sig.outputs[0].shape, vec![-1, 4]);
        assert_eq!(model.external_locations, vec!["w.bin".to_owned()]);
    }

    #[test]
    fn unsupported_types_name_the_tensor() {
        let graph = ld(11, &tensor_value_info("bf", 16, &[Ok(2)]));
        let model = ModelFile::parse(&ld(7, &graph)).unwrap();
        let err = model.signature().unwrap_err();
        assert!(err.contains("'bf'") && err.contains("BFLOAT16"), "{err}");

        let seq = [ld(1, b"s"), ld(2, &ld(4, &[]))].concat();
        let err = ModelFile::parse(&ld(7, &ld(12, &seq))).unwrap().signature().unwrap_err();
        assert!(err.contains("output 's' is a sequence"), "{err}");
    }

    #[test]
    fn finds_external_data_in_subgraphs_and_ignores_inline_locations() {
        let inner = ld(5, &external_tensor("C", "inner.bin"));
        let attr = [ld(1, b"then_branch"), ld(6, &inner)].concat();
        let node = ld(5, &attr);
        // A location without data_location = EXTERNAL is not external data.
        let inline = [ld(8, b"D"), ld(13, &[ld(1, b"location"), ld(2, b"ignored.bin")].concat())].concat();
        let graph = [ld(1, &node), ld(5, &inline)].concat();
        let model = ModelFile::parse(&ld(7, &graph)).unwrap();
        assert_eq!(model.external_locations, vec!["inner.bin".to_owned()]);
    }

    #[test]
    fn garbage_and_graphless_files_are_errors() {
        assert!(ModelFile::parse(b"\x08\x07this is not an onnx model").is_err());
        assert!(ModelFile::parse(&varint(1, 8)).unwrap_err().contains("no graph"));
        // Deeply nested subgraphs are refused, not recursed into without bound.
        let mut graph = Vec::new();
        for _ in 0..(MAX_GRAPH_DEPTH + 2) {
            graph = ld(1, &ld(5, &ld(6, &graph)));
        }
        assert!(ModelFile::parse(&ld(7, &graph)).unwrap_err().contains("nested"));
    }
}
