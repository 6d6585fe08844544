//! The MatMuls of the unpacked forms, turned around so that no run packs a weight.
//!
//! ONNX Runtime's CPU MatMul (MLAS SGEMM) copies its right-hand operand into column
//! panels before it multiplies, unless the operand is a constant the session prepacked at
//! load. The `mapped` and `compact` forms do not prepack (their weights are used in place,
//! which is what makes their loads take milliseconds), so every run of two rows or more
//! packs each weight matrix again: on the Zipf benchmark's 100 MiB MLP under churn that
//! copy was 62% of the server's CPU (`bench/README.md`). Since `A · W = (Wᵀ · Aᵀ)ᵀ`, a
//! copy that stores `Wᵀ` and puts it on the left has the runtime pack the activations
//! instead (`K x M`: a batch's rows, kilobytes) and read the weight once, in place. One
//! row, which MLAS multiplies without packing either way, would be slower so (a product
//! with a one-column right-hand side); it takes `Gemm(A, Wᵀ, transB = 1)` instead, which
//! MLAS runs as dot products along `Wᵀ`'s rows, chosen at run time by an `If` on the
//! row count.
//!
//! Rewritten: a main-graph `MatMul(A, W)` whose `W` is an inline FLOAT initializer of
//! shape `[K, N]` with `N >= MIN_COLUMNS` and at least `MIN_BYTES` (8 MiB), every use of
//! which is such a MatMul, and whose `A` is known to have rank 2 (from the graph's declared
//! inputs and value infos, carried through elementwise ops), in a model of opset
//! `MIN_OPSET` or later. `Wᵀ` is stored under `W`'s name (see `Plan::rewrite_node` for the
//! nodes). The sums are the same products over the same `K` in other kernels, so outputs
//! agree to rounding, not bit for bit. A prepacked session is faster still, and packs
//! nothing at run time either; the prepacked copy is made from the `.onnx`. Graphs with
//! subgraphs (`If`, `Loop`, `Scan`) are left as they are: an outer weight may be used
//! inside them (so a turned graph is never turned again).

use std::collections::{HashMap, HashSet};

use crate::{
    onnx_file::declared_rank,
    proto::{put_bytes_field, put_varint_field, Fields},
};

/// The default domain's version a model must import: the rewrite's `Gemm` has no bias.
pub(crate) const MIN_OPSET: u64 = 11;
/// Smaller weights gain less than they lose (measured on 2 cores, no prepacking: the 10 MiB
/// MLP's 5 MiB matrices run one row 1.17x slower, the `If` and its shape ops costing
/// ~0.05 ms, for 0.81-0.96x on 2-8 rows, and the mix benchmark runs that model one row at
/// a time; the 100 MiB MLP's 50 MiB ones 0.82x on one row, 0.60-0.74x on 2-16).
const MIN_BYTES: usize = 8 << 20;
/// The transposed product has `N` rows to share among the threads; with few, the packed
/// activations (`K x M`) could outweigh the weight they replace.
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

/// The weights to store transposed, by name, with their stored shape `(K, N)`.
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
    zero: String,
    one: String,
    shape: String,
    rows: String,
    single: String,
    input_t: String,
    product_t: String,
    branch_out: String,
}

impl Names {
    fn of(output: &str) -> Names {
        let name = |what: &str| format!("{output}/snooze_turned_{what}");
        Names {
            zero: name("zero"),
            one: name("one"),
            shape: name("input_shape"),
            rows: name("rows"),
            single: name("one_row"),
            input_t: name("input_t"),
            product_t: name("product_t"),
            branch_out: name("out"),
        }
    }

    fn all(&self) -> [&str; 8] {
        [
            &self.zero,
            &self.one,
            &self.shape,
            &self.rows,
            &self.single,
            &self.input_t,
            &self.product_t,
            &self.branch_out,
        ]
    }
}

impl Plan {
    pub(crate) fn is_empty(&self) -> bool {
        self.weights.is_empty()
    }

    /// `(K, N)` of the weight `name` if it is to be stored transposed (as `N x K`).
    pub(crate) fn weight(&self, name: &str) -> Option<(usize, usize)> {
        self.weights.get(name).copied()
    }

    /// The nodes that replace `node` (a NodeProto), or `None` if it stays as it is: for
    /// `y = MatMul(A, W)`, `rows = Gather(Shape(A), [0])` and `y = If(rows == [1])`, whose
    /// branches both read the one stored `Wᵀ`: one row, `Gemm(A, Wᵀ, transB = 1)` (MLAS's
    /// one-row kernel for a transposed right-hand side: dot products along `Wᵀ`'s rows,
    /// nothing packed); more, `Transpose(MatMul(Wᵀ, Transpose(A)))`.
    pub(crate) fn rewrite_node(&self, node: &[u8]) -> Result<Option<Vec<Vec<u8>>>, String> {
        if self.is_empty() {
            return Ok(None);
        }
        let n = parse_node(node)?;
        if !n.is_matmul() || !self.weights.contains_key(n.inputs[1]) {
            return Ok(None);
        }
        let (a, w, y) = (n.inputs[0], n.inputs[1], n.outputs[0]);
        let t = Names::of(y);
        let named =
            |what: &str| if n.name.is_empty() { String::new() } else { format!("{}/snooze_{what}", n.name) };
        let perm = attribute_ints("perm", &[1, 0]);
        let out = &t.branch_out;
        let one_row =
            branch("one_row", &[encode_node("", "Gemm", &[a, w], out, &[attribute_int("transB", 1)])], out);
        let rows = branch(
            "rows",
            &[
                encode_node("", "Transpose", &[a], &t.input_t, std::slice::from_ref(&perm)),
                encode_node("", "MatMul", &[w, &t.input_t], &t.product_t, &[]),
                encode_node("", "Transpose", &[&t.product_t], out, &[perm]),
            ],
            out,
        );
        let constant = |value: i64| attribute_tensor("value", &int64_vector(value));
        Ok(Some(vec![
            encode_node(&named("zero"), "Constant", &[], &t.zero, &[constant(0)]),
            encode_node(&named("one"), "Constant", &[], &t.one, &[constant(1)]),
            encode_node(&named("shape"), "Shape", &[a], &t.shape, &[]),
            encode_node(&named("rows"), "Gather", &[&t.shape, &t.zero], &t.rows, &[attribute_int("axis", 0)]),
            encode_node(&named("one_row"), "Equal", &[&t.rows, &t.one], &t.single, &[]),
            encode_node(
                n.name,
                "If",
                &[&t.single],
                y,
                &[attribute_graph("then_branch", &one_row), attribute_graph("else_branch", &rows)],
            ),
        ]))
    }
}

/// What to transpose in the GraphProto `graph` (see the module's doc). A graph that does
/// not parse is an error; one with nothing to turn around gives an empty plan.
pub(crate) fn plan(graph: &[u8]) -> Result<Plan, String> {
    let mut nodes = Vec::new();
    // Initializers by name, with the shape they would be transposed from, if they qualify.
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
    // Per weight: (uses, uses as the right-hand side of a MatMul that can be turned).
    let mut uses: HashMap<&str, (usize, usize)> = HashMap::new();
    for n in &nodes {
        for (i, &input) in n.inputs.iter().enumerate() {
            if !initializers.contains_key(input) {
                continue;
            }
            let counts = uses.entry(input).or_default();
            counts.0 += 1;
            let turnable = i == 1
                && n.is_matmul()
                && ranks.get(n.inputs[0]) == Some(&2)
                && !Names::of(n.outputs[0]).all().iter().any(|t| names.contains(t));
            counts.1 += usize::from(turnable);
        }
    }
    let weights = initializers
        .into_iter()
        .filter_map(|(name, shape)| {
            let (all, turnable) = uses.get(name).copied().unwrap_or_default();
            (all > 0 && all == turnable && !interface.contains(name)).then_some((name.to_owned(), shape?))
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

/// An initializer's name, rank and, if it can be stored transposed, `(K, N)`.
type Initializer<'a> = (&'a str, usize, Option<(usize, usize)>);

/// TensorProto: dims = 1, data_type = 2, segment = 3, name = 8, raw_data = 9,
/// external_data = 13, data_location = 14. Its name, rank and, if it can be stored
/// transposed (inline FLOAT `[K, N]` of at least `MIN_BYTES`, `N >= MIN_COLUMNS`), `(K, N)`.
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
                bytes == Some(len) && len >= MIN_BYTES && n >= MIN_COLUMNS && k > 0
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

// AttributeProto: name = 1, i = 3, t = 5, g = 6, ints = 8, type = 20 (INT = 2,
// TENSOR = 4, GRAPH = 5, INTS = 7).
fn attribute(name: &str, kind: u64, value: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::new();
    put_bytes_field(&mut out, 1, name.as_bytes());
    value(&mut out);
    put_varint_field(&mut out, 20, kind);
    out
}

fn attribute_int(name: &str, value: u64) -> Vec<u8> {
    attribute(name, 2, |out| put_varint_field(out, 3, value))
}

fn attribute_ints(name: &str, values: &[u64]) -> Vec<u8> {
    attribute(name, 7, |out| values.iter().for_each(|v| put_varint_field(out, 8, *v)))
}

fn attribute_tensor(name: &str, tensor: &[u8]) -> Vec<u8> {
    attribute(name, 4, |out| put_bytes_field(out, 5, tensor))
}

fn attribute_graph(name: &str, graph: &[u8]) -> Vec<u8> {
    attribute(name, 5, |out| put_bytes_field(out, 6, graph))
}

/// A TensorProto of one INT64 (dims = 1, data_type = 2: INT64 = 7, raw_data = 9).
fn int64_vector(value: i64) -> Vec<u8> {
    let mut out = Vec::new();
    put_varint_field(&mut out, 1, 1);
    put_varint_field(&mut out, 2, 7);
    put_bytes_field(&mut out, 9, &value.to_le_bytes());
    out
}

/// A GraphProto (node = 1, name = 2, output = 12) of `nodes` whose one output is the
/// FLOAT tensor `output` (ValueInfoProto name = 1, type = 2; TypeProto.tensor_type = 1;
/// elem_type = 1: FLOAT).
fn branch(name: &str, nodes: &[Vec<u8>], output: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for node in nodes {
        put_bytes_field(&mut out, 1, node);
    }
    put_bytes_field(&mut out, 2, name.as_bytes());
    let mut tensor_type = Vec::new();
    put_varint_field(&mut tensor_type, 1, 1);
    let mut type_proto = Vec::new();
    put_bytes_field(&mut type_proto, 1, &tensor_type);
    let mut info = Vec::new();
    put_bytes_field(&mut info, 1, output.as_bytes());
    put_bytes_field(&mut info, 2, &type_proto);
    put_bytes_field(&mut out, 12, &info);
    out
}

/// Writes the `k x n` matrix of 4-byte elements `bytes` (row-major) transposed, `n x k`,
/// a few MiB at a time: the weight is read in place (a mapping), never held whole.
pub(crate) fn write_transposed(
    out: &mut impl std::io::Write,
    bytes: &[u8],
    k: usize,
    n: usize,
) -> std::io::Result<()> {
    write_transposed_by(out, bytes, k, n, 4 << 20)
}

/// [`write_transposed`], `chunk` bytes of the output at a time.
fn write_transposed_by(
    out: &mut impl std::io::Write,
    bytes: &[u8],
    k: usize,
    n: usize,
    chunk: usize,
) -> std::io::Result<()> {
    assert_eq!(bytes.len(), k * n * 4, "a {k} x {n} matrix of 4-byte elements");
    // Tiles of TILE x TILE elements (16 KiB): read row by row, written column by column
    // within the caches; element by element across the whole matrix, every write would
    // miss (545 ms instead of ~100 for the 100 MiB MLP's two matrices).
    const TILE: usize = 64;
    let rows = (chunk / (k * 4)).clamp(1, n);
    let mut buf = vec![0u8; rows * k * 4];
    let mut first = 0;
    while first < n {
        let r = rows.min(n - first);
        for k0 in (0..k).step_by(TILE) {
            for j0 in (0..r).step_by(TILE) {
                let j1 = (j0 + TILE).min(r);
                for kk in k0..(k0 + TILE).min(k) {
                    let from = &bytes[(kk * n + first + j0) * 4..(kk * n + first + j1) * 4];
                    for (j, element) in (j0..j1).zip(from.chunks_exact(4)) {
                        let at = (j * k + kk) * 4;
                        buf[at..at + 4].copy_from_slice(element);
                    }
                }
            }
        }
        out.write_all(&buf[..r * k * 4])?;
        first += r;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
