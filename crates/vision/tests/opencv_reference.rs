//! The geometry against the numbers OpenCV and pyclipper gave in
//! scripts/ocr_fixture.py (tests/fixtures/ocr_reference.json, "geometry"): the
//! bilinear resize and the bicubic perspective crop pixel for pixel, and the unclip
//! offset vertex for vertex.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use serde_json::Value;
use snooze_vision::{
    crop_box,
    geometry::{mini_box, HullStart},
    resize::resize_linear,
    unclip::offset_polygon,
    BgrImage,
};

fn geometry() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/ocr_reference.json");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    json["geometry"].clone()
}

fn image(v: &Value) -> BgrImage {
    let hex = v["bgr"].as_str().unwrap();
    let bytes = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    BgrImage::from_bgr(v["width"].as_u64().unwrap() as usize, v["height"].as_u64().unwrap() as usize, bytes)
        .unwrap()
}

/// Bytes that differ, and the largest difference.
fn compare(a: &BgrImage, b: &BgrImage) -> (usize, u8) {
    assert_eq!((a.width(), a.height()), (b.width(), b.height()));
    a.data()
        .iter()
        .zip(b.data())
        .filter(|(x, y)| x != y)
        .fold((0, 0), |(n, m), (x, y)| (n + 1, m.max(x.abs_diff(*y))))
}

#[test]
fn resize_matches_cv2_bit_for_bit() {
    let g = geometry();
    let src = image(&g["source"]);
    for case in g["resize"].as_array().unwrap() {
        let expected = image(case);
        let got = resize_linear(&src, expected.width(), expected.height());
        let (differ, worst) = compare(&got, &expected);
        assert_eq!(
            differ,
            0,
            "{}x{}: {differ} bytes differ (worst by {worst})",
            expected.width(),
            expected.height()
        );
    }
}

#[test]
fn perspective_crops_match_cv2() {
    let g = geometry();
    let src = image(&g["source"]);
    for case in g["warp"].as_array().unwrap() {
        let expected = image(case);
        let q = case["quad"].as_array().unwrap();
        let p = |i: usize, j: usize| q[i][j].as_f64().unwrap() as f32;
        let quad = [[p(0, 0), p(0, 1)], [p(1, 0), p(1, 1)], [p(2, 0), p(2, 1)], [p(3, 0), p(3, 1)]];
        let mut got = crop_box(&src, &quad);
        if got.width() != expected.width() {
            // crop_box turns tall crops; the fixture holds cv2's unturned warp.
            got = got.rotate90_ccw().rotate180();
        }
        let (differ, worst) = compare(&got, &expected);
        println!("warp {quad:?}: {differ} of {} bytes differ, worst by {worst}", got.data().len());
        assert_eq!(differ, 0, "{quad:?}");
    }
}

#[test]
fn unclip_matches_pyclipper() {
    let g = geometry();
    for case in g["unclip"].as_array().unwrap() {
        let b = case["box"].as_array().unwrap();
        let quad: Vec<[f32; 2]> =
            b.iter().map(|p| [p[0].as_f64().unwrap() as f32, p[1].as_f64().unwrap() as f32]).collect();
        let distance = case["distance"].as_f64().unwrap();
        let quad4 = [quad[0], quad[1], quad[2], quad[3]];
        assert!((snooze_vision::unclip::unclip_distance(&quad4, 1.6) - distance).abs() < 1e-9);
        let mut got = offset_polygon(&quad, distance);
        let mut expected: Vec<[i64; 2]> = case["offset"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| [p[0].as_i64().unwrap(), p[1].as_i64().unwrap()])
            .collect();
        got.sort();
        got.dedup();
        expected.sort();
        // Clipper's union drops collinear vertices: every vertex it kept is one of ours.
        for p in &expected {
            assert!(got.contains(p), "{p:?} from pyclipper is missing in {got:?}");
        }
        let points: Vec<[f64; 2]> = got.iter().map(|p| [p[0] as f64, p[1] as f64]).collect();
        let (_, short) = mini_box(&points, HullStart::Leftmost).unwrap();
        let expected_short = case["rect_short_side"].as_f64().unwrap();
        assert!((f64::from(short) - expected_short).abs() < 1e-3, "{short} vs cv2 {expected_short}");
    }
}
