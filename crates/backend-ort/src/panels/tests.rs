//! What is stored as panels, and how.

#![allow(clippy::unwrap_used)]

use super::*;
use crate::proto::{bytes_field, varint_field, Value};

fn node(op: &str, inputs: &[&str], output: &str) -> Vec<u8> {
    encode_node(&format!("{op}_{output}"), op, "", inputs, output)
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

fn paneled(plan: &Plan) -> Vec<(String, (usize, usize))> {
    let mut w: Vec<_> = plan.weights.iter().map(|(k, v)| (k.clone(), *v)).collect();
    w.sort();
    w
}

#[test]
fn the_matmuls_of_a_rank_2_mlp_read_their_weights_as_panels() {
    let plan = plan(&mlp(Some(2), &[])).unwrap();
    assert_eq!(paneled(&plan), [("W1".to_owned(), (256, 8192)), ("W2".to_owned(), (8192, 256))]);
    // Both 8 MiB matrices, not the 32 KiB bias: nearly all of the weights.
    assert!(plan.share() > 0.99 && plan.share() <= 1.0, "{}", plan.share());
    let rewritten = plan.rewrite_node(&node("MatMul", &["h2", "W2"], "y")).unwrap().unwrap();
    // The same inputs, output and name, the operator of `panel_op` (NodeProto domain = 7).
    let n = parse_node(&rewritten).unwrap();
    assert_eq!((n.op, n.inputs, n.outputs, n.name), ("PanelMatMul", vec!["h2", "W2"], vec!["y"], "MatMul_y"));
    let fields: Vec<_> = Fields::new(&rewritten).map(Result::unwrap).collect();
    assert_eq!(fields.last(), Some(&(7, Value::Bytes(b"ai.snooze"))));
    assert!(!n.standard, "not the default domain's");
    assert!(plan.rewrite_node(&node("Add", &["h0", "B1"], "h1")).unwrap().is_none());
}

#[test]
fn only_what_is_known_to_be_safe_is_rewritten() {
    let none = |g: &[u8]| plan(g).unwrap().is_empty();
    assert!(none(&mlp(Some(3), &[])), "a rank-3 input (a transformer's tokens)");
    assert!(none(&mlp(None, &[])), "an input of unknown rank");
    // A weight also used by another op: it must stay as it is, and so do its MatMuls.
    let shared = plan(&mlp(Some(2), &[bytes_field(1, &node("Identity", &["W1"], "w1_copy"))])).unwrap();
    assert_eq!(paneled(&shared), [("W2".to_owned(), (8192, 256))]);
    assert!((shared.share() - 0.5).abs() < 0.01, "one of two matrices: {}", shared.share());
    // A weight that is also a graph output, or an input (an overridable constant).
    let output = plan(&mlp(Some(2), &[bytes_field(12, &input("W2", Some(2)))])).unwrap();
    assert_eq!(paneled(&output), [("W1".to_owned(), (256, 8192))]);
    // A subgraph anywhere (an If's branch may use an outer weight): nothing.
    let branch = bytes_field(5, &[bytes_field(1, b"then_branch"), bytes_field(6, b"")].concat());
    let with_if = [node("If", &["cond"], "out"), branch].concat();
    assert!(none(&mlp(Some(2), &[bytes_field(1, &with_if)])));
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
    assert!(!plan(&graph(weight("W", 256, 4096))).unwrap().is_empty(), "4 MiB, the least");
    assert!(plan(&graph(weight("W", 256, 2048))).unwrap().is_empty(), "2 MiB: gains too little");
    assert!(plan(&graph(weight("W", 32768, 128))).unwrap().is_empty(), "128 columns");
    assert!(plan(&graph(weight("W", 256, 8200))).unwrap().is_empty(), "8200 columns: not whole panels");
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
    assert_eq!(paneled(&plan(&graph(packed)).unwrap()), [("W".to_owned(), (256, 8192))]);
    assert!(plan(&[0x0a, 0x05, 1]).is_err(), "a graph cut short is an error");
}

#[test]
fn a_matrix_is_written_as_panels_a_chunk_at_a_time() {
    let (k, n) = (3, 5 * PANEL);
    let m: Vec<u32> = (0..(k * n) as u32).collect();
    let bytes: Vec<u8> = m.iter().flat_map(|v| v.to_le_bytes()).collect();
    // One panel at a time (a chunk smaller than a panel), two, three (the last short), all.
    for chunk in [1, 2 * k * PANEL * 4, 3 * k * PANEL * 4, 1 << 20] {
        let mut out = Vec::new();
        write_panels_by(&mut out, &bytes, k, n, chunk).unwrap();
        let got: Vec<u32> = out.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        let m = &m;
        let want: Vec<u32> = (0..n / PANEL)
            .flat_map(|p| (0..k).flat_map(move |r| (0..PANEL).map(move |c| m[r * n + p * PANEL + c])))
            .collect();
        assert_eq!(got, want, "chunk {chunk}");
    }
}
