//! The MatMuls of the unpacked forms, their weights stored in panels so that no run
//! packs a weight by strides.
//!
//! ONNX Runtime's CPU MatMul (MLAS SGEMM) copies its right-hand operand into panels of
//! 16 columns (a panel: `K` rows of 16 elements) before it multiplies, unless the operand
//! is a constant the session prepacked at load. The `mapped` and `compact` forms do not
//! prepack (their weights are used in place, which is what makes their loads take
//! milliseconds), so every run of two rows or more packs each weight matrix again, 64
//! bytes from each of its rows at a time: on the Zipf benchmark's 100 MiB MLP under churn
//! that copy was 62% of the server's CPU (`bench/README.md`). The copy instead stores a
//! big weight `W` (`K x N`) as its panels, `[N / PANEL, K, PANEL]`, and the MatMul reads
//! them as a batch: `A` (`M x K`) broadcast over the `N / PANEL` panels, one `M x K` by
//! `K x PANEL` product each, whose right-hand side the runtime still packs, but from 4
//! KiB of contiguous memory into the caches it is read from; `Transpose` and `Reshape`
//! put the `N / PANEL` slices of `M x PANEL` back side by side as `M x N`. Measured on the
//! 100 MiB MLP (2 cores, ONNX Runtime 1.32, against a prepacked session): one row 1.03x,
//! 2-8 rows 1.41-1.54x, 16 rows 1.50x, 64 rows 1.25x; the weight as it is 1.39x, 2.0-2.15x,
//! 1.84x, 1.27x; the copy before this one (the weight stored transposed and put on the
//! left) 1.26x, 1.63-1.96x, 1.25x, 1.08x: faster only from 16 rows, where a model that
//! stays is promoted to prepacked anyway.
//!
//! Rewritten: a main-graph `MatMul(A, W)` whose `W` is an inline FLOAT initializer of
//! shape `[K, N]` with `N` a multiple of `PANEL`, `N >= MIN_COLUMNS` and at least
//! `MIN_BYTES` (4 MiB), every use of which is such a MatMul, and whose `A` is known to
//! have rank 2 (from the graph's declared inputs and value infos, carried through
//! elementwise ops), in a model of opset `MIN_OPSET` or later. The panels are stored under
//! `W`'s name (see `Plan::rewrite_node` for the nodes). Each output element is the same
//! sum over the same `K` by another kernel, so outputs agree to rounding, not bit for bit.
//! A prepacked session is faster still, and packs nothing at run time either; the
//! prepacked copy is made from the `.onnx`. Graphs with subgraphs (`If`, `Loop`, `Scan`)
//! are left as they are: an outer weight may be used inside them.

use std::collections::{HashMap, HashSet};

use crate::{
    onnx_file::declared_rank,
    proto::{put_bytes_field, put_varint_field, Fields},
};

/// The default domain's version a model must import: the rewrite's `Reshape` takes its
/// shape as an input (opset 5).
pub(crate) const MIN_OPSET: u64 = 5;
/// Columns in a panel: MLAS's SGEMM kernel computes 16 columns at a time. Measured on the
/// 100 MiB MLP (2 cores), 32, 64 and 128 were slower on 2-8 rows (1.1-1.4x) and no faster
/// on one.
pub(crate) const PANEL: usize = 16;
/// Smaller weights gain less (measured on 2 cores, no prepacking, against the weights as
/// they are: 5 MiB matrices (the 10 MiB MLP) 0.81-0.93x on one row, 0.70-0.89x on 2-8,
/// 0.93x on 16; 2 MiB 0.9x, 0.7x and 1.0x, hundredths of a millisecond; 1 MiB 1.1x on one
/// row and 1.2x on 16, where the added nodes cost more than the packing they save).
const MIN_BYTES: usize = 4 << 20;
/// Fewer panels than 16 (`N / PANEL`) give the threads, which share them out, little to share.
const MIN_COLUMNS: usize = 256;

/// Ops whose output has the rank of their first input.
const SAME_RANK: [&str; 31] = [
    "Abs",
    "Cast",
    "Ceil",
    "Celu",
    "Clip",
    "Cos",
    "Dropout",
    "Elu",
    "Erf",
    "Exp",
    "Floor",
    "Gelu",
    "HardSigmoid",
    "HardSwish",
    "Identity",
    "LeakyRelu",
    "Log",
    "LogSoftmax",
    "Mish",
    "Neg",
    "Reciprocal",
    "Relu",
    "Round",
    "Selu",
    "Sigmoid",
    "Sign",
    "Sin",
    "Softmax",
    "Softplus",
    "Sqrt",
    "Tanh",
];
/// Elementwise ops that broadcast: the output has the largest rank of their inputs.
const BROADCAST: [&str; 10] = ["Add", "Div", "Max", "Mean", "Min", "Mul", "Pow", "PRelu", "Sub", "Sum"];

/// The weights to store as panels, by name, with their shape `(K, N)`.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    weights: HashMap<String, (usize, usize)>,
}

struct Node<'a> {
    op: &'a str,
    standard: bool,
    inputs: Vec<&'a str>,
    outputs: Vec<&'a str>,
    name: &'a str,
    subgraph: bool,
}

impl Node<'_> {
    fn is_matmul(&self) -> bool {
        self.standard && self.op == "MatMul" && self.inputs.len() == 2 && self.outputs.len() == 1
    }
}

/// The tensors a rewritten MatMul's nodes add, named after its output.
struct Names {
    /// `[N / PANEL, M, PANEL]`: the product with each panel.
    slices: String,
    /// `[M, N / PANEL, PANEL]`.
    rows: String,
    /// `[0, N]`, for the `Reshape`.
    shape: String,
}

impl Names {
    fn of(output: &str) -> Names {
        let name = |what: &str| format!("{output}/snooze_panels_{what}");
        Names { slices: name("slices"), rows: name("rows"), shape: name("shape") }
    }

    fn all(&self) -> [&str; 3] {
        [&self.slices, &self.rows, &self.shape]
    }
}

impl Plan {
    pub(crate) fn is_empty(&self) -> bool {
        self.weights.is_empty()
    }

    /// `(K, N)` of the weight `name` if it is to be stored as panels
    /// (`[N / PANEL, K, PANEL]`).
    pub(crate) fn weight(&self, name: &str) -> Option<(usize, usize)> {
        self.weights.get(name).copied()
    }

    /// The nodes that replace `node` (a NodeProto), or `None` if it stays as it is: for
    /// `y = MatMul(A, W)`, `W` stored as panels,
    /// `y = Reshape(Transpose(MatMul(A, W), perm = [1, 0, 2]), [0, N])`.
    pub(crate) fn rewrite_node(&self, node: &[u8]) -> Result<Option<Vec<Vec<u8>>>, String> {
        if self.is_empty() {
            return Ok(None);
        }
        let n = parse_node(node)?;
        if !n.is_matmul() {
            return Ok(None);
        }
        let Some(&(_, columns)) = self.weights.get(n.inputs[1]) else { return Ok(None) };
        let (a, w, y) = (n.inputs[0], n.inputs[1], n.outputs[0]);
        let t = Names::of(y);
        let named =
            |what: &str| if n.name.is_empty() { String::new() } else { format!("{}/snooze_{what}", n.name) };
        let columns = i64::try_from(columns).map_err(|_| format!("{w}: {columns} columns"))?;
        let shape = attribute_tensor("value", &int64_vector(&[0, columns]));
        Ok(Some(vec![
            encode_node(&named("panels"), "MatMul", &[a, w], &t.slices, &[]),
            encode_node(
                &named("rows"),
                "Transpose",
                &[&t.slices],
                &t.rows,
                &[attribute_ints("perm", &[1, 0, 2])],
            ),
            encode_node(&named("shape"), "Constant", &[], &t.shape, &[shape]),
            encode_node(n.name, "Reshape", &[&t.rows, &t.shape], y, &[]),
        ]))
    }
}

/// What to store as panels in the GraphProto `graph` (see the module's doc). A graph that does
/// not parse is an error; one with nothing to rewrite gives an empty plan.
pub(crate) fn plan(graph: &[u8]) -> Result<Plan, String> {
    let mut nodes = Vec::new();
    // Initializers by name, with their shape if they qualify.
    let mut initializers: HashMap<&str, Option<(usize, usize)>> = HashMap::new();
    let mut ranks: HashMap<String, usize> = HashMap::new();
    // Graph inputs and outputs: a weight that is one stays as it is.
    let mut interface: HashSet<String> = HashSet::new();
    for field in Fields::new(graph) {
        match field? {
            (1, v) => nodes.push(parse_node(v.bytes(1)?)?),
            (5, v) => {
                let (name, dims, candidate) = initializer(v.bytes(5)?)?;
                ranks.insert(name.to_owned(), dims);
                initializers.insert(name, candidate);
            }
            (n @ 11..=13, v) => {
                let (name, rank) = declared_rank(v.bytes(n)?)?;
                if let Some(rank) = rank {
                    ranks.insert(name.clone(), rank);
                }
                if n != 13 {
                    interface.insert(name);
                }
            }
            _ => {}
        }
    }
    if nodes.iter().any(|n| n.subgraph) {
        return Ok(Plan::default());
    }
    for n in &nodes {
        if let (Some(rank), Some(out)) = (output_rank(n, &ranks), n.outputs.first()) {
            ranks.entry((*out).to_owned()).or_insert(rank);
        }
    }
    let mut names: HashSet<&str> = initializers.keys().copied().collect();
    names.extend(nodes.iter().flat_map(|n| n.inputs.iter().chain(&n.outputs).copied()));
    names.extend(interface.iter().map(String::as_str));
    // Per weight: (uses, uses as the right-hand side of a MatMul that can be rewritten).
    let mut uses: HashMap<&str, (usize, usize)> = HashMap::new();
    for n in &nodes {
        for (i, &input) in n.inputs.iter().enumerate() {
            if !initializers.contains_key(input) {
                continue;
            }
            let counts = uses.entry(input).or_default();
            counts.0 += 1;
            let rewritable = i == 1
                && n.is_matmul()
                && ranks.get(n.inputs[0]) == Some(&2)
                && !Names::of(n.outputs[0]).all().iter().any(|t| names.contains(t));
            counts.1 += usize::from(rewritable);
        }
    }
    let weights = initializers
        .into_iter()
        .filter_map(|(name, shape)| {
            let (all, rewritable) = uses.get(name).copied().unwrap_or_default();
            (all > 0 && all == rewritable && !interface.contains(name)).then_some((name.to_owned(), shape?))
        })
        .collect();
    Ok(Plan { weights })
}

/// The rank of `n`'s first output, where the op and its inputs' ranks say it.
fn output_rank(n: &Node<'_>, ranks: &HashMap<String, usize>) -> Option<usize> {
    if !n.standard {
        return None;
    }
    let rank = |name: &str| ranks.get(name).copied();
    match n.op {
        "MatMul" if n.inputs.len() == 2 => (rank(n.inputs[0])? == 2 && rank(n.inputs[1])? == 2).then_some(2),
        "Gemm" => Some(2),
        op if SAME_RANK.contains(&op) => rank(n.inputs.first()?),
        op if BROADCAST.contains(&op) => {
            n.inputs.iter().filter(|i| !i.is_empty()).map(|i| rank(i)).try_fold(0, |a, r| Some(a.max(r?)))
        }
        _ => None,
    }
}

/// NodeProto: input = 1, output = 2, name = 3, op_type = 4, attribute = 5, domain = 7;
/// AttributeProto: g = 6, graphs = 11.
fn parse_node(buf: &[u8]) -> Result<Node<'_>, String> {
    let mut n =
        Node { op: "", standard: true, inputs: Vec::new(), outputs: Vec::new(), name: "", subgraph: false };
    for field in Fields::new(buf) {
        match field? {
            (1, v) => n.inputs.push(v.string(1)?),
            (2, v) => n.outputs.push(v.string(2)?),
            (3, v) => n.name = v.string(3)?,
            (4, v) => n.op = v.string(4)?,
            (7, v) => n.standard = matches!(v.string(7)?, "" | "ai.onnx"),
            (5, v) => {
                for field in Fields::new(v.bytes(5)?) {
                    n.subgraph |= matches!(field?.0, 6 | 11);
                }
            }
            _ => {}
        }
    }
    Ok(n)
}

/// An initializer's name, rank and, if it can be stored as panels, `(K, N)`.
type Initializer<'a> = (&'a str, usize, Option<(usize, usize)>);

/// TensorProto: dims = 1, data_type = 2, segment = 3, name = 8, raw_data = 9,
/// external_data = 13, data_location = 14. Its name, rank and, if it can be stored as
/// panels (inline FLOAT `[K, N]` of at least `MIN_BYTES`, `N >= MIN_COLUMNS`, `N` a
/// multiple of `PANEL`), `(K, N)`.
fn initializer(buf: &[u8]) -> Result<Initializer<'_>, String> {
    let (mut name, mut dims, mut data_type, mut raw, mut other) = ("", Vec::new(), 0, None, false);
    for field in Fields::new(buf) {
        match field? {
            (1, crate::proto::Value::Bytes(packed)) => {
                for d in Fields::packed_varints(packed) {
                    dims.push(d?);
                }
            }
            (1, v) => dims.push(v.varint(1)?),
            (2, v) => data_type = v.varint(2)?,
            (8, v) => name = v.string(8)?,
            (9, v) => raw = Some(v.bytes(9)?.len()),
            (3 | 13 | 14, _) => other = true,
            _ => {}
        }
    }
    let candidate = match (data_type, dims.as_slice(), raw, other) {
        (1, &[k, n], Some(len), false) => {
            usize::try_from(k).ok().zip(usize::try_from(n).ok()).filter(|&(k, n)| {
                let bytes = k.checked_mul(n).and_then(|e| e.checked_mul(4));
                bytes == Some(len) && len >= MIN_BYTES && n >= MIN_COLUMNS && n % PANEL == 0 && k > 0
            })
        }
        _ => None,
    };
    Ok((name, dims.len(), candidate))
}

/// A NodeProto of the default domain with its AttributeProtos, encoded.
fn encode_node(name: &str, op: &str, inputs: &[&str], output: &str, attributes: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for input in inputs {
        put_bytes_field(&mut out, 1, input.as_bytes());
    }
    put_bytes_field(&mut out, 2, output.as_bytes());
    if !name.is_empty() {
        put_bytes_field(&mut out, 3, name.as_bytes());
    }
    put_bytes_field(&mut out, 4, op.as_bytes());
    for attribute in attributes {
        put_bytes_field(&mut out, 5, attribute);
    }
    out
}

// AttributeProto: name = 1, t = 5, ints = 8, type = 20 (TENSOR = 4, INTS = 7).
fn attribute(name: &str, kind: u64, value: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::new();
    put_bytes_field(&mut out, 1, name.as_bytes());
    value(&mut out);
    put_varint_field(&mut out, 20, kind);
    out
}

fn attribute_ints(name: &str, values: &[u64]) -> Vec<u8> {
    attribute(name, 7, |out| values.iter().for_each(|v| put_varint_field(out, 8, *v)))
}

fn attribute_tensor(name: &str, tensor: &[u8]) -> Vec<u8> {
    attribute(name, 4, |out| put_bytes_field(out, 5, tensor))
}

/// A TensorProto of a vector of INT64 (dims = 1, data_type = 2: INT64 = 7, raw_data = 9).
fn int64_vector(values: &[i64]) -> Vec<u8> {
    let mut out = Vec::new();
    put_varint_field(&mut out, 1, values.len() as u64);
    put_varint_field(&mut out, 2, 7);
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    put_bytes_field(&mut out, 9, &raw);
    out
}

/// The shape a `k x n` weight is stored in as panels.
pub(crate) fn stored_dims(k: usize, n: usize) -> [usize; 3] {
    [n / PANEL, k, PANEL]
}

/// Writes the `k x n` matrix of 4-byte elements `bytes` (row-major) as its panels,
/// `[n / PANEL, k, PANEL]`, a few MiB at a time: the weight is read in place (a mapping),
/// never held whole.
pub(crate) fn write_panels(
    out: &mut impl std::io::Write,
    bytes: &[u8],
    k: usize,
    n: usize,
) -> std::io::Result<()> {
    write_panels_by(out, bytes, k, n, 4 << 20)
}

/// [`write_panels`], the panels of `chunk` bytes of the output (at least one) at a time.
fn write_panels_by(
    out: &mut impl std::io::Write,
    bytes: &[u8],
    k: usize,
    n: usize,
    chunk: usize,
) -> std::io::Result<()> {
    assert_eq!(bytes.len(), k * n * 4, "a {k} x {n} matrix of 4-byte elements");
    assert_eq!(n % PANEL, 0, "{n} columns make whole panels of {PANEL}");
    let row = PANEL * 4;
    let panels = n / PANEL;
    let per_chunk = (chunk / (k * row)).clamp(1, panels);
    let mut buf = vec![0u8; per_chunk * k * row];
    for first in (0..panels).step_by(per_chunk) {
        let count = per_chunk.min(panels - first);
        // Along each row of the matrix (contiguous), each panel's 64 bytes to its place.
        for r in 0..k {
            let from = &bytes[(r * n + first * PANEL) * 4..(r * n + (first + count) * PANEL) * 4];
            for (p, piece) in from.chunks_exact(row).enumerate() {
                let at = (p * k + r) * row;
                buf[at..at + row].copy_from_slice(piece);
            }
        }
        out.write_all(&buf[..count * k * row])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
