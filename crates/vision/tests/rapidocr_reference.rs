//! The whole pipeline with the real PP-OCR models (ONNX Runtime through
//! snooze-backend-ort) against rapidocr 3.10 on the same pages
//! (scripts/ocr_fixture.py → tests/fixtures/ocr_reference.json): the detector's
//! boxes, the final lines' texts (share equal, character error rate), boxes and
//! scores; the PDF page against the text it was written with; and the time spent in
//! this crate's functions next to the models'.
#![allow(clippy::unwrap_used)]

mod common;

use common::{models, reference, root};
use std::time::{Duration, Instant};

use serde_json::Value;
use snooze_core::Tensor;
use snooze_vision::{
    read_page, text_boxes, BgrImage, Document, InputLimits, OcrOptions, Page, Stage, StageTimes, VisionError,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Runs a stage's model; keeps the detector's output for the box comparison.
fn runner<'a>(det_output: &'a mut Option<Tensor>) -> impl FnMut(Stage, Tensor) -> Result<Tensor, Error> + 'a {
    move |stage, input| {
        let m = models();
        let model = match stage {
            Stage::Detector => &m.det,
            Stage::Classifier => &m.cls,
            Stage::Recognizer => &m.rec,
        };
        let out = model.infer(&[input], &[])?.into_iter().next().ok_or("the model gave no output")?;
        if stage == Stage::Detector {
            *det_output = Some(out.clone());
        }
        Ok(out)
    }
}

fn read(image: &BgrImage) -> (Page, StageTimes, Option<Tensor>) {
    let mut det = None;
    let mut run = runner(&mut det);
    let (page, times) = read_page(image, &OcrOptions::default(), &models().decoder, &mut run).unwrap();
    drop(run);
    (page, times, det)
}

/// Levenshtein distance in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut diag = row[0];
        row[0] = i;
        for j in 1..=b.len() {
            let keep = diag + usize::from(a[i - 1] != b[j - 1]);
            diag = row[j];
            row[j] = keep.min(row[j] + 1).min(row[j - 1] + 1);
        }
    }
    row[b.len()]
}

fn center(quad: &[[f32; 2]; 4]) -> [f32; 2] {
    [quad.iter().map(|p| p[0]).sum::<f32>() / 4.0, quad.iter().map(|p| p[1]).sum::<f32>() / 4.0]
}

fn quad_of(v: &Value) -> [[f32; 2]; 4] {
    let p = |i: usize, j: usize| v[i][j].as_f64().unwrap() as f32;
    [[p(0, 0), p(0, 1)], [p(1, 0), p(1, 1)], [p(2, 0), p(2, 1)], [p(3, 0), p(3, 1)]]
}

#[derive(Default)]
struct Tally {
    lines: usize,
    equal: usize,
    chars: usize,
    edits: usize,
    det_boxes: usize,
    det_equal: usize,
    worst_box: f32,
    worst_score: f32,
    times: Vec<(String, StageTimes)>,
}

#[test]
fn pages_read_like_rapidocr() {
    let limits = InputLimits::default();
    let mut tally = Tally::default();
    for page_ref in reference()["pages"].as_array().unwrap() {
        let file = page_ref["file"].as_str().unwrap();
        let bytes = std::fs::read(root().join("tests/fixtures").join(file)).unwrap();
        let doc = Document::open(bytes, &limits).unwrap();
        let image = doc.render_page(0, &limits).unwrap().image;
        let (page, times, det) = read(&image);

        // The detector's boxes, on the padded image rapidocr's detector saw.
        let [dw, dh] = [0, 1].map(|i| page_ref["det_image"][i].as_u64().unwrap() as usize);
        let ours = text_boxes(det.as_ref().unwrap(), dw, dh, &OcrOptions::default()).unwrap();
        let theirs: Vec<[[f32; 2]; 4]> =
            page_ref["det_boxes"].as_array().unwrap().iter().map(quad_of).collect();
        let same = theirs.iter().filter(|q| ours.iter().any(|b| &b.quad == *q)).count();
        tally.det_boxes += theirs.len();
        tally.det_equal += same;
        if same != theirs.len() || ours.len() != theirs.len() {
            println!("{file}: detector boxes: {same} of {} equal, {} found", theirs.len(), ours.len());
            for q in theirs.iter().filter(|q| !ours.iter().any(|b| &b.quad == *q)) {
                let c = center(q);
                let near = ours.iter().min_by(|a, b| {
                    let d = |x: &[[f32; 2]; 4]| (center(x)[0] - c[0]).abs() + (center(x)[1] - c[1]).abs();
                    d(&a.quad).total_cmp(&d(&b.quad))
                });
                println!("  rapidocr {q:?}, ours {:?}", near.map(|b| b.quad));
            }
        }

        // Final lines, paired by order when the counts agree, else by nearest centre.
        let expected = page_ref["lines"].as_array().unwrap();
        for (i, line) in expected.iter().enumerate() {
            let text = line["text"].as_str().unwrap();
            let quad = quad_of(&line["box"]);
            let got = if page.lines.len() == expected.len() {
                Some(&page.lines[i])
            } else {
                let c = center(&quad);
                page.lines.iter().min_by(|a, b| {
                    let d = |l: &&snooze_vision::Line| {
                        let o = center(&l.quad);
                        (o[0] - c[0]).powi(2) + (o[1] - c[1]).powi(2)
                    };
                    d(a).total_cmp(&d(b))
                })
            };
            tally.lines += 1;
            tally.chars += text.chars().count();
            match got {
                Some(l) => {
                    tally.edits += edit_distance(text, &l.text);
                    if l.text == text {
                        tally.equal += 1;
                        let off = l
                            .quad
                            .iter()
                            .zip(&quad)
                            .map(|(a, b)| (a[0] - b[0]).abs().max((a[1] - b[1]).abs()));
                        tally.worst_box = off.fold(tally.worst_box, f32::max);
                        let score = line["score"].as_f64().unwrap() as f32;
                        tally.worst_score = tally.worst_score.max((l.score - score).abs());
                    } else {
                        println!(
                            "{file}: rapidocr {text:?} ({:.4}), ours {:?} ({:.4})",
                            line["score"], l.text, l.score
                        );
                    }
                }
                None => {
                    tally.edits += text.chars().count();
                    println!("{file}: rapidocr {text:?}, ours nothing");
                }
            }
        }
        if page.lines.len() != expected.len() {
            println!("{file}: {} lines, rapidocr {}", page.lines.len(), expected.len());
        }
        tally.times.push((file.to_owned(), times));
    }

    let share = tally.equal as f64 / tally.lines as f64;
    let cer = tally.edits as f64 / tally.chars as f64;
    println!(
        "detector boxes equal to rapidocr's: {} of {}; lines with equal text: {} of {} ({:.1}%); \
         character error rate {:.3}% ({} edits in {} chars); equal lines' boxes within {} px, scores within {:.5}",
        tally.det_equal,
        tally.det_boxes,
        tally.equal,
        tally.lines,
        share * 100.0,
        cer * 100.0,
        tally.edits,
        tally.chars,
        tally.worst_box,
        tally.worst_score
    );
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    for (file, t) in &tally.times {
        println!(
            "{file}: ours {:.1} ms (det pre {:.1}, det post + crops {:.1}, cls {:.1}, rec {:.1}); models {:.1} ms \
             (det {:.1}, cls {:.1} in {} runs, rec {:.1} in {} runs)",
            ms(t.processing()),
            ms(t.det_pre),
            ms(t.det_post),
            ms(t.cls_pre_post),
            ms(t.rec_pre_post),
            ms(t.models()),
            ms(t.det_model),
            ms(t.cls_model),
            t.runs[1],
            ms(t.rec_model),
            t.runs[2]
        );
    }
    assert!(share >= 0.95, "only {:.1}% of lines have rapidocr's text", share * 100.0);
    assert!(cer <= 0.01, "character error rate {:.3}% against rapidocr", cer * 100.0);
    assert!(tally.det_equal as f64 >= 0.95 * tally.det_boxes as f64, "detector boxes differ from rapidocr's");
}

#[test]
fn a_pdf_page_reads_as_written() {
    let pdf = &reference()["pdf"];
    let limits = InputLimits::default();
    let bytes = std::fs::read(root().join("tests/fixtures").join(pdf["file"].as_str().unwrap())).unwrap();
    let rss = || snooze_core::memory::process_rss_bytes() as f64 / f64::from(1 << 20);
    snooze_core::memory::trim_heap();
    let before = rss();
    let started = Instant::now();
    let doc = Document::open(bytes, &limits).unwrap();
    let rendered = doc.render_page(0, &limits).unwrap();
    let render_ms = started.elapsed().as_secs_f64() * 1000.0;
    let after = rss();
    assert_eq!((rendered.image.width(), rendered.image.height(), rendered.dpi), (1239, 1754, Some(150.0)));
    println!("A4 text page at 150 DPI: rendered in {render_ms:.0} ms, RSS +{:.1} MiB", after - before);

    let (page, _, _) = read(&rendered.image);
    let written: Vec<&str> =
        pdf["lines"].as_array().unwrap().iter().map(|l| l["text"].as_str().unwrap()).collect();
    let (mut edits, mut chars) = (0, 0);
    for text in &written {
        let best = page.lines.iter().map(|l| edit_distance(text, &l.text)).min().unwrap_or(text.len());
        if best > 0 {
            println!("PDF: {text:?} read with {best} edits");
        }
        edits += best;
        chars += text.chars().count();
    }
    println!("PDF: {} lines read; {edits} edits in {chars} written characters", page.lines.len());
    assert!(edits as f64 <= 0.02 * chars as f64, "{}", page.text);

    let locked = std::fs::read(root().join("tests/fixtures").join(pdf["locked"].as_str().unwrap())).unwrap();
    let err = Document::open(locked, &limits).err().unwrap();
    assert_eq!(err, VisionError::EncryptedPdf);
}

#[test]
fn lines_are_found_where_they_were_drawn() {
    // The upside-down page: the classifier turns two crops, and the texts come out right.
    let page_ref = reference()["pages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["file"] == "ocr_pages/upside_down.png")
        .unwrap();
    let bytes =
        std::fs::read(root().join("tests/fixtures").join(page_ref["file"].as_str().unwrap())).unwrap();
    let image =
        snooze_vision::decode_image(&bytes, snooze_vision::ImageKind::Png, &InputLimits::default()).unwrap();
    let (page, times, _) = read(&image);
    let drawn: Vec<&str> =
        page_ref["drawn"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let texts: Vec<&str> = page.lines.iter().map(|l| l.text.as_str()).collect();
    assert_eq!(texts, drawn);
    assert!(times.runs[1] >= 1 && times.runs[2] >= 1);
}
