//! What is turned around, and how.

#![allow(clippy::unwrap_used)]

use super::*;
use crate::proto::{bytes_field, varint_field, Value};

fn node(op: &str, inputs: &[&str], output: &str) -> Vec<u8> {
    encode_node(&format!("{op}_{output}"), op, inputs, output, &[])
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
            &[varint_field(1, 8192), varint_field(2, 1), bytes_field(8, b"B1"), bytes_field(9, &[0; 32768])]
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
    let t = |what: &str| format!("y/snooze_turned_{what}");
    let summary = |nodes: &[Vec<u8>]| -> Vec<(String, Vec<String>, Vec<String>)> {
        let owned = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        nodes
            .iter()
            .map(|n| parse_node(n).unwrap())
            .map(|n| (n.op.to_owned(), owned(&n.inputs), owned(&n.outputs)))
            .collect()
    };
    let row = |op: &str, inputs: &[&str], output: &str| {
        (op.to_owned(), inputs.iter().map(|s| (*s).to_owned()).collect(), vec![output.to_owned()])
    };
    let (zero, one, shape, rows, single) = (t("zero"), t("one"), t("input_shape"), t("rows"), t("one_row"));
    assert_eq!(
        summary(&nodes),
        [
            row("Constant", &[], &zero),
            row("Constant", &[], &one),
            row("Shape", &["h2"], &shape),
            row("Gather", &[&shape, &zero], &rows),
            row("Equal", &[&rows, &one], &single),
            row("If", &[&single], "y"),
        ]
    );
    assert_eq!(parse_node(&nodes[5]).unwrap().name, "MatMul_y", "the If takes the MatMul's name");
    // The attributes, by name: each AttributeProto's name = 1, then its value.
    let attributes = |node: &[u8]| -> Vec<(String, Vec<u8>)> {
        Fields::new(node)
            .map(Result::unwrap)
            .filter(|(f, _)| *f == 5)
            .map(|(_, a)| {
                let a = a.bytes(5).unwrap();
                let name = Fields::new(a).map(Result::unwrap).find(|(f, _)| *f == 1).unwrap().1;
                (name.string(1).unwrap().to_owned(), a.to_vec())
            })
            .collect()
    };
    // Constants [0] and [1]: TensorProto dims [1], INT64, raw little-endian.
    for (node, value) in [(&nodes[0], 0i64), (&nodes[1], 1)] {
        let [(name, a)] = attributes(node).try_into().unwrap();
        assert_eq!(name, "value");
        let tensor = Fields::new(&a).map(Result::unwrap).find(|(f, _)| *f == 5).unwrap().1.bytes(5).unwrap();
        let fields: Vec<_> = Fields::new(tensor).map(Result::unwrap).collect();
        let raw = value.to_le_bytes();
        assert_eq!(fields, [(1, Value::Varint(1)), (2, Value::Varint(7)), (9, Value::Bytes(&raw))]);
    }
    // The branches: one row, Gemm(A, Wt, transB = 1); more, the turned MatMul.
    let branches: Vec<(String, Vec<Vec<u8>>)> = attributes(&nodes[5])
        .into_iter()
        .map(|(name, a)| {
            let g = Fields::new(&a)
                .map(Result::unwrap)
                .find(|(f, _)| *f == 6)
                .unwrap()
                .1
                .bytes(6)
                .unwrap()
                .to_vec();
            let nodes = Fields::new(&g)
                .map(Result::unwrap)
                .filter(|(f, _)| *f == 1)
                .map(|(_, n)| n.bytes(1).unwrap().to_vec())
                .collect();
            (name, nodes)
        })
        .collect();
    assert_eq!(branches.len(), 2);
    let (out, at, yt) = (t("out"), t("input_t"), t("product_t"));
    assert_eq!(branches[0].0, "then_branch");
    assert_eq!(summary(&branches[0].1), [row("Gemm", &["h2", "W2"], &out)]);
    let gemm = attributes(&branches[0].1[0]);
    assert_eq!(gemm[0].0, "transB");
    assert!(gemm[0].1.ends_with(&[0x18, 1, 0xa0, 1, 2]), "transB = 1 (i = 3, type INT = 2)");
    assert_eq!(branches[1].0, "else_branch");
    assert_eq!(
        summary(&branches[1].1),
        [row("Transpose", &["h2"], &at), row("MatMul", &["W2", &at], &yt), row("Transpose", &[&yt], &out)]
    );
    for transpose in [&branches[1].1[0], &branches[1].1[2]] {
        let [(name, a)] = attributes(transpose).try_into().unwrap();
        let fields: Vec<_> = Fields::new(&a).map(Result::unwrap).collect();
        assert_eq!(name, "perm");
        assert_eq!(fields[1..], [(8, Value::Varint(1)), (8, Value::Varint(0)), (20, Value::Varint(7))]);
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
        plan(&mlp(Some(2), &[bytes_field(1, &node("Relu", &["y"], "y/snooze_turned_rows"))])).unwrap();
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
    assert!(!plan(&graph(weight("W", 256, 8192))).unwrap().is_empty(), "the control: 8 MiB, 8192 columns");
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
        let t: Vec<u32> = out.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        let m = &m;
        let want: Vec<u32> = (0..n).flat_map(|j| (0..k).map(move |i| m[i * n + j])).collect();
        assert_eq!(t, want, "chunk {chunk}");
    }
}
