//! The MatMuls of the unpacked forms, turned around so that no run packs a weight.
//!
//! ONNX Runtime's CPU MatMul (MLAS SGEMM) copies its right-hand operand into column
//! panels before it multiplies, unless the operand is a constant the session prepacked at
//! load. The `mapped` and `compact` forms do not prepack (their weights are used in place,
//! which is what makes their loads take milliseconds), so every run of two rows or more
//! packs each weight matrix again: on the Zipf benchmark's 100 MiB MLP under churn that
//! copy was 62% of the server's CPU (`bench/README.md`). Since `A · W = (Wᵀ · Aᵀ)ᵀ`, a
//! copy that stores `Wᵀ` and puts it on the left has the runtime pack the activations
//! instead (`K x M`: a batch's rows, kilobytes) and read the weight once, in place. ONNX
//! Runtime's transpose optimiser then cancels the transposes between consecutive layers.
//!
//! Rewritten: a main-graph `MatMul(A, W)` whose `W` is an inline FLOAT initializer of shape
//! `[K, N]` with `N >= MIN_COLUMNS` and at least `MIN_BYTES` (8 MiB), every use of which is such a
//! MatMul, and whose `A` is known to have rank 2 (from the graph's declared inputs and
//! value infos, carried through elementwise ops). It becomes
//! `Transpose(MatMul(Wᵀ, Transpose(A)))`, `Wᵀ` stored under `W`'s name. The sums are the
//! same products over the same `K` in another kernel, so outputs agree to rounding, not
//! bit for bit. A prepacked session is faster still, and packs nothing at run time either;
//! the prepacked copy is made from the `.onnx`. Graphs with subgraphs (`If`, `Loop`,
//! `Scan`) are left as they are: an outer weight may be used inside them.

use std::collections::{HashMap, HashSet};

use crate::{
    onnx_file::declared_rank,
    proto::{put_bytes_field, put_varint_field, Fields},
};

/// Smaller weights gain less than they lose: one row is multiplied without packing
/// either way, and turned it runs slower (measured on 2 cores, no prepacking: the 10 MiB
/// MLP's 5 MiB matrices 1.58x slower on one row for 0.73-0.94x on 2-16 rows, and the mix
/// benchmark runs that model one row at a time; the 100 MiB MLP's 50 MiB ones 1.19x
/// slower on one row for 0.62-0.73x on 2-16).
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

/// A rewritten node's intermediate tensors: the transposed input and product.
fn inner_names(output: &str) -> (String, String) {
    (format!("{output}/snooze_transposed_input"), format!("{output}/snooze_transposed_product"))
}

impl Plan {
    pub(crate) fn is_empty(&self) -> bool {
        self.weights.is_empty()
    }

    /// `(K, N)` of the weight `name` if it is to be stored transposed (as `N x K`).
    pub(crate) fn weight(&self, name: &str) -> Option<(usize, usize)> {
        self.weights.get(name).copied()
    }

    /// The nodes that replace `node` (a NodeProto), or `None` if it stays as it is.
    pub(crate) fn rewrite_node(&self, node: &[u8]) -> Result<Option<[Vec<u8>; 3]>, String> {
        if self.is_empty() {
            return Ok(None);
        }
        let n = parse_node(node)?;
        if !n.is_matmul() || !self.weights.contains_key(n.inputs[1]) {
            return Ok(None);
        }
        let (a, w, y) = (n.inputs[0], n.inputs[1], n.outputs[0]);
        let (at, yt) = inner_names(y);
        let named =
            |suffix: &str| if n.name.is_empty() { String::new() } else { format!("{}{suffix}", n.name) };
        Ok(Some([
            encode_node(&named("/snooze_transpose_input"), "Transpose", &[a], &at, true),
            encode_node(n.name, "MatMul", &[w, &at], &yt, false),
            encode_node(&named("/snooze_transpose_product"), "Transpose", &[&yt], y, true),
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
            let turnable = i == 1 && n.is_matmul() && ranks.get(n.inputs[0]) == Some(&2) && {
                let (at, yt) = inner_names(n.outputs[0]);
                !names.contains(at.as_str()) && !names.contains(yt.as_str())
            };
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

/// A NodeProto of the default domain; `perm`: with the attribute `perm = [1, 0]`.
fn encode_node(name: &str, op: &str, inputs: &[&str], output: &str, perm: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for input in inputs {
        put_bytes_field(&mut out, 1, input.as_bytes());
    }
    put_bytes_field(&mut out, 2, output.as_bytes());
    if !name.is_empty() {
        put_bytes_field(&mut out, 3, name.as_bytes());
    }
    put_bytes_field(&mut out, 4, op.as_bytes());
    if perm {
        // AttributeProto: name = 1, ints = 8, type = 20 (INTS = 7).
        let mut attr = Vec::new();
        put_bytes_field(&mut attr, 1, b"perm");
        put_varint_field(&mut attr, 8, 1);
        put_varint_field(&mut attr, 8, 0);
        put_varint_field(&mut attr, 20, 7);
        put_bytes_field(&mut out, 5, &attr);
    }
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
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::proto::{bytes_field, varint_field, Value};

    fn node(op: &str, inputs: &[&str], output: &str) -> Vec<u8> {
        encode_node(&format!("{op}_{output}"), op, inputs, output, false)
    }

    /// A FLOAT initializer `[k, n]` with inline data.
    fn weight(name: &str, k: usize, n: usize) -> Vec<u8> {
        [
            varint_field(1, k as u64),
            varint_field(1, n as u64),
            varint_field(2, 1),
            bytes_field(8, name.as_bytes()),
            bytes_field(9, &vec![0; k * n * 4]),
        ]
        .concat()
    }

    /// A graph input of rank `rank` (ValueInfoProto with a FLOAT tensor type), or of no
    /// declared shape.
    fn input(name: &str, rank: Option<usize>) -> Vec<u8> {
        let shape = rank.map(|r| bytes_field(2, &vec![bytes_field(1, &varint_field(1, 256)); r].concat()));
        let tensor = [varint_field(1, 1), shape.unwrap_or_default()].concat();
        [bytes_field(1, name.as_bytes()), bytes_field(2, &bytes_field(1, &tensor))].concat()
    }

    /// x -> MatMul(W1 [256, 8192]) -> Add(B1) -> Relu -> MatMul(W2 [8192, 256]) = y, with
    /// `extra` graph fields.
    fn mlp(x_rank: Option<usize>, extra: &[Vec<u8>]) -> Vec<u8> {
        let mut g = [
            bytes_field(1, &node("MatMul", &["x", "W1"], "h0")),
            bytes_field(1, &node("Add", &["h0", "B1"], "h1")),
            bytes_field(1, &node("Relu", &["h1"], "h2")),
            bytes_field(1, &node("MatMul", &["h2", "W2"], "y")),
            bytes_field(5, &weight("W1", 256, 8192)),
            bytes_field(
                5,
                &[
                    varint_field(1, 8192),
                    varint_field(2, 1),
                    bytes_field(8, b"B1"),
                    bytes_field(9, &[0; 32768]),
                ]
                .concat(),
            ),
            bytes_field(5, &weight("W2", 8192, 256)),
            bytes_field(11, &input("x", x_rank)),
        ]
        .concat();
        g.extend(extra.iter().flatten());
        g
    }

    fn turned(plan: &Plan) -> Vec<(String, (usize, usize))> {
        let mut w: Vec<_> = plan.weights.iter().map(|(k, v)| (k.clone(), *v)).collect();
        w.sort();
        w
    }

    #[test]
    fn the_matmuls_of_a_rank_2_mlp_are_turned_and_their_weights_stored_transposed() {
        let plan = plan(&mlp(Some(2), &[])).unwrap();
        assert_eq!(turned(&plan), [("W1".to_owned(), (256, 8192)), ("W2".to_owned(), (8192, 256))]);
        let nodes = plan.rewrite_node(&node("MatMul", &["h2", "W2"], "y")).unwrap().unwrap();
        let parsed: Vec<_> = nodes.iter().map(|n| parse_node(n).unwrap()).collect();
        let at = "y/snooze_transposed_input";
        let yt = "y/snooze_transposed_product";
        let shape: Vec<_> = parsed.iter().map(|n| (n.op, n.inputs.clone(), n.outputs.clone())).collect();
        assert_eq!(
            shape,
            [
                ("Transpose", vec!["h2"], vec![at]),
                ("MatMul", vec!["W2", at], vec![yt]),
                ("Transpose", vec![yt], vec!["y"]),
            ]
        );
        assert_eq!(parsed[1].name, "MatMul_y", "the MatMul keeps its name");
        // perm = [1, 0] on both transposes: AttributeProto name = 1, ints = 8, type = 20.
        for n in [&nodes[0], &nodes[2]] {
            let attr = Fields::new(n).map(Result::unwrap).find(|(f, _)| *f == 5).unwrap().1;
            let fields: Vec<_> = Fields::new(attr.bytes(5).unwrap()).map(Result::unwrap).collect();
            assert_eq!(
                fields,
                [
                    (1, Value::Bytes(b"perm")),
                    (8, Value::Varint(1)),
                    (8, Value::Varint(0)),
                    (20, Value::Varint(7))
                ]
            );
        }
        assert!(plan.rewrite_node(&node("Add", &["h0", "B1"], "h1")).unwrap().is_none());
    }

    #[test]
    fn only_what_is_known_to_be_safe_is_turned() {
        let none = |g: &[u8]| plan(g).unwrap().is_empty();
        assert!(none(&mlp(Some(3), &[])), "a rank-3 input (a transformer's tokens)");
        assert!(none(&mlp(None, &[])), "an input of unknown rank");
        // A weight also used by another op: it must stay as it is, and so do its MatMuls.
        let shared = plan(&mlp(Some(2), &[bytes_field(1, &node("Identity", &["W1"], "w1_copy"))])).unwrap();
        assert_eq!(turned(&shared), [("W2".to_owned(), (8192, 256))]);
        // A weight that is also a graph output, or an input (an overridable constant).
        let output = plan(&mlp(Some(2), &[bytes_field(12, &input("W2", Some(2)))])).unwrap();
        assert_eq!(turned(&output), [("W1".to_owned(), (256, 8192))]);
        // A subgraph anywhere (an If's branch may use an outer weight): nothing.
        let branch = bytes_field(5, &[bytes_field(1, b"then_branch"), bytes_field(6, b"")].concat());
        let with_if = [node("If", &["cond"], "out"), branch].concat();
        assert!(none(&mlp(Some(2), &[bytes_field(1, &with_if)])));
        // A name the rewrite would give already taken: that MatMul stays.
        let taken =
            plan(&mlp(Some(2), &[bytes_field(1, &node("Relu", &["y"], "y/snooze_transposed_product"))]))
                .unwrap();
        assert_eq!(turned(&taken), [("W1".to_owned(), (256, 8192))]);
    }

    #[test]
    fn small_narrow_external_or_non_float_weights_stay() {
        let graph = |w: Vec<u8>| {
            [
                bytes_field(1, &node("MatMul", &["x", "W"], "y")),
                bytes_field(5, &w),
                bytes_field(11, &input("x", Some(2))),
            ]
            .concat()
        };
        assert!(
            !plan(&graph(weight("W", 256, 8192))).unwrap().is_empty(),
            "the control: 8 MiB, 8192 columns"
        );
        assert!(plan(&graph(weight("W", 256, 4096))).unwrap().is_empty(), "4 MiB: gains less than it loses");
        assert!(plan(&graph(weight("W", 32768, 128))).unwrap().is_empty(), "128 columns");
        let mut double = weight("W", 256, 8192);
        double.extend(varint_field(2, 11));
        assert!(plan(&graph(double)).unwrap().is_empty(), "DOUBLE");
        let short = [
            varint_field(1, 256),
            varint_field(1, 8192),
            varint_field(2, 1),
            bytes_field(8, b"W"),
            bytes_field(9, &[0; 4096]),
        ]
        .concat();
        assert!(plan(&graph(short)).unwrap().is_empty(), "data shorter than its shape");
        let mut external = weight("W", 256, 8192);
        external.extend(varint_field(14, 1));
        assert!(plan(&graph(external)).unwrap().is_empty(), "external data");
        // Dims written packed, as some exporters do: read the same.
        let packed = [
            bytes_field(1, &[0x80, 0x02, 0x80, 0x40]),
            varint_field(2, 1),
            bytes_field(8, b"W"),
            bytes_field(9, &vec![0; 8 << 20]),
        ]
        .concat();
        assert_eq!(turned(&plan(&graph(packed)).unwrap()), [("W".to_owned(), (256, 8192))]);
        assert!(plan(&[0x0a, 0x05, 1]).is_err(), "a graph cut short is an error");
    }

    #[test]
    fn a_matrix_is_written_transposed_a_chunk_at_a_time() {
        let (k, n) = (3, 5);
        let m: Vec<u32> = (0..(k * n) as u32).collect();
        let bytes: Vec<u8> = m.iter().flat_map(|v| v.to_le_bytes()).collect();
        for chunk in [1, 12, 24, 1 << 20] {
            let mut out = Vec::new();
            write_transposed_by(&mut out, &bytes, k, n, chunk).unwrap();
            let t: Vec<u32> =
                out.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
            let m = &m;
            let want: Vec<u32> = (0..n).flat_map(|j| (0..k).map(move |i| m[i * n + j])).collect();
            assert_eq!(t, want, "chunk {chunk}");
        }
    }
}
