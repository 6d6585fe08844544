//! The MatMuls of the unpacked forms, their weights stored in panels that a run reads in
//! place.
//!
//! ONNX Runtime's CPU MatMul (MLAS SGEMM) copies its right-hand operand into panels of
//! 16 columns (a panel: `K` rows of 16 elements) before it multiplies, unless the operand
//! is a constant the session prepacked at load. The `mapped` and `compact` forms do not
//! prepack (their weights are used in place, which is what makes their loads take
//! milliseconds), so every run of two rows or more packed each weight matrix again, 64
//! bytes from each of its rows at a time: on the Zipf benchmark's 100 MiB MLP under churn
//! that copy was 62% of the server's CPU (`bench/README.md`). The copy instead stores a
//! big weight `W` (`K x N`) as its panels, `[N / PANEL, K, PANEL]`, and its MatMul becomes
//! `ai.snooze.PanelMatMul` (`panel_op`), whose kernel (`panel_gemm`) multiplies from the
//! panels where they lie, as MLAS does from a prepacked buffer. Measured on the 100 MiB
//! MLP (2 cores, ONNX Runtime 1.32), against a prepacked session: 0.86-1.03x its time on
//! 1-64 rows (`tests/panels_speed.rs`); the weight as it is took 1.39x on one row,
//! 2.0-2.15x on 2-8 and 1.84x on 16; the panels multiplied by ONNX Runtime's own batched
//! MatMul (the copy before this one, which still packed each panel) 1.03x, 1.41-1.54x and
//! 1.50x.
//!
//! Rewritten: a main-graph `MatMul(A, W)` whose `W` is an inline FLOAT initializer of
//! shape `[K, N]` with `N` a multiple of `PANEL`, `N >= MIN_COLUMNS` and at least
//! `MIN_BYTES` (4 MiB), every use of which is such a MatMul, and whose `A` is known to
//! have rank 2 (from the graph's declared inputs and value infos, carried through
//! elementwise ops). The panels are stored under `W`'s name, and the model imports the
//! operator's domain (`external::rewrite`). Each output element is the same sum over the
//! same `K` by another kernel, so outputs agree to rounding, not bit for bit. The
//! prepacked copy is made from the `.onnx`. Graphs with subgraphs (`If`, `Loop`, `Scan`)
//! are left as they are: an outer weight may be used inside them.

use std::collections::{HashMap, HashSet};

use crate::{
    onnx_file::declared_rank,
    panel_op,
    proto::{put_bytes_field, Fields},
};

/// Columns in a panel: a 16-float vector register (two 8-float ones), as MLAS packs them.
pub(crate) const PANEL: usize = 16;
/// Smaller weights gain less. Chosen with the form before (panels multiplied by ONNX
/// Runtime's MatMul, measured on 2 cores, no prepacking, against the weights as they are:
/// 5 MiB matrices (the 10 MiB MLP) 0.81-0.93x on one row, 0.70-0.89x on 2-8, 0.93x on
/// 16; 2 MiB 0.9x, 0.7x and 1.0x, hundredths of a millisecond; 1 MiB 1.1x on one row and
/// 1.2x on 16) and kept: the transformers and convolutions with smaller weights are not
/// rewritten anyway, for their activations' rank.
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
    /// The encoded size of every initializer of the graph: about its weights' bytes.
    initializer_bytes: usize,
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

impl Plan {
    pub(crate) fn is_empty(&self) -> bool {
        self.weights.is_empty()
    }

    /// The share of the graph's weight bytes stored as panels (0 to 1).
    pub(crate) fn share(&self) -> f64 {
        let paneled: usize = self.weights.values().map(|(k, n)| k * n * 4).sum();
        if self.initializer_bytes == 0 {
            return 0.0;
        }
        (paneled as f64 / self.initializer_bytes as f64).min(1.0)
    }

    /// `(K, N)` of the weight `name` if it is to be stored as panels
    /// (`[N / PANEL, K, PANEL]`).
    pub(crate) fn weight(&self, name: &str) -> Option<(usize, usize)> {
        self.weights.get(name).copied()
    }

    /// The node that replaces `node` (a NodeProto), or `None` if it stays as it is: for
    /// `y = MatMul(A, W)`, `W` stored as panels, `y = ai.snooze.PanelMatMul(A, W)` (see
    /// `panel_op`), under the same name.
    pub(crate) fn rewrite_node(&self, node: &[u8]) -> Result<Option<Vec<u8>>, String> {
        if self.is_empty() {
            return Ok(None);
        }
        let n = parse_node(node)?;
        if !n.is_matmul() || !self.weights.contains_key(n.inputs[1]) {
            return Ok(None);
        }
        Ok(Some(encode_node(n.name, panel_op::NAME, panel_op::DOMAIN, &n.inputs, n.outputs[0])))
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
    let mut initializer_bytes = 0;
    for field in Fields::new(graph) {
        match field? {
            (1, v) => nodes.push(parse_node(v.bytes(1)?)?),
            (5, v) => {
                initializer_bytes += v.bytes(5)?.len();
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
    // Per weight: (uses, uses as the right-hand side of a MatMul that can be rewritten).
    let mut uses: HashMap<&str, (usize, usize)> = HashMap::new();
    for n in &nodes {
        for (i, &input) in n.inputs.iter().enumerate() {
            if !initializers.contains_key(input) {
                continue;
            }
            let counts = uses.entry(input).or_default();
            counts.0 += 1;
            let rewritable = i == 1 && n.is_matmul() && ranks.get(n.inputs[0]) == Some(&2);
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
    Ok(Plan { weights, initializer_bytes })
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

/// A NodeProto of `domain`, without attributes, encoded (NodeProto: input = 1, output =
/// 2, name = 3, op_type = 4, domain = 7).
fn encode_node(name: &str, op: &str, domain: &str, inputs: &[&str], output: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for input in inputs {
        put_bytes_field(&mut out, 1, input.as_bytes());
    }
    put_bytes_field(&mut out, 2, output.as_bytes());
    if !name.is_empty() {
        put_bytes_field(&mut out, 3, name.as_bytes());
    }
    put_bytes_field(&mut out, 4, op.as_bytes());
    put_bytes_field(&mut out, 7, domain.as_bytes());
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
