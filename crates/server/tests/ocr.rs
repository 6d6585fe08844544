//! OCR as a service through the real binary: `POST /v1/ocr` reads the fixture pages
//! (rendered text in several fonts, a rotated and an upside-down page, a JPEG, a tiny
//! crop) exactly as rapidocr 3.10 reads them (`tests/fixtures/ocr_reference.json`), with
//! four clients at once batched across requests; a PDF made here page by page is read
//! page by page, by selection, as multipart or JSON; hostile documents get a 4xx naming
//! what is wrong and change nothing; a long PDF is read in page batches whose memory
//! does not grow with the page count.

#![allow(clippy::unwrap_used)]

#[path = "common/audio.rs"]
mod audio;
mod common;
#[path = "common/pdf.rs"]
mod pdf;

use std::{path::PathBuf, thread};

use base64::Engine;
use common::*;
use serde_json::{json, Value};

/// The default pipeline over rapidocr's PP-OCRv6 models, with `extra` settings in it.
fn config(extra: &str) -> String {
    let dir = models_dir();
    format!(
        "[server]\nmax_pages = 60\nqueue_timeout = \"300s\"\n\
         [models.ocr-det]\npath = \"{0}/ocr-det\"\n\
         [models.ocr-cls]\npath = \"{0}/ocr-cls\"\n\
         [models.ocr-rec]\npath = \"{0}/ocr-rec\"\n\
         [models.mlp-10m]\npath = \"{0}/mlp-10m\"\n\
         [pipelines.ocr]\ndet = \"ocr-det\"\ncls = \"ocr-cls\"\nrec = \"ocr-rec\"\n{extra}\n\
         [pipelines.no-cls]\ndet = \"ocr-det\"\nrec = \"ocr-rec\"\n\
         [pipelines.swapped]\ndet = \"ocr-rec\"\nrec = \"ocr-det\"\n",
        dir.display()
    )
}

fn fixtures() -> PathBuf {
    repo_root().join("tests/fixtures")
}

/// POSTs `bytes` as the multipart `file` with `fields`; status and JSON body.
fn ocr(server: &Server, bytes: Vec<u8>, name: &str, fields: &[(&str, &str)]) -> (u16, Value) {
    audio::post_ocr(&server.base, &bytes, name, fields)
}

fn lines(page: &Value) -> Vec<String> {
    page["lines"].as_array().expect("lines").iter().map(|l| l["text"].as_str().unwrap().to_string()).collect()
}

/// The server's peak resident memory so far (VmHWM), in bytes.
fn peak_rss(server: &Server) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id())).expect("status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn four_clients_read_the_fixture_pages_as_rapidocr_reads_them() {
    let reference: Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("ocr_reference.json")).unwrap()).unwrap();
    let server = Server::start("ocr-fixtures", &config(""), &[]);
    // A rotated page (the classifier turns its lines), an upside-down one, a JPEG, a crop.
    let chosen = [
        "ocr_pages/rotated.png",
        "ocr_pages/upside_down.png",
        "ocr_pages/fonts_jpeg.jpg",
        "ocr_pages/small.png",
    ];
    let pages: Vec<&Value> = reference["pages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| chosen.contains(&p["file"].as_str().unwrap()))
        .collect();
    assert_eq!(pages.len(), chosen.len(), "the reference lacks a chosen page");
    let answers: Vec<(u16, Value)> = thread::scope(|s| {
        let running: Vec<_> = pages
            .iter()
            .map(|p| {
                let file = p["file"].as_str().unwrap().to_string();
                let server = &server;
                s.spawn(move || ocr(server, std::fs::read(fixtures().join(&file)).unwrap(), &file, &[]))
            })
            .collect();
        running.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (page, (status, body)) in pages.iter().zip(&answers) {
        assert_eq!(*status, 200, "{}: {body}", page["file"]);
        let expected: Vec<String> = page["lines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["text"].as_str().unwrap().to_string())
            .collect();
        let got = &body["pages"][0];
        assert_eq!(lines(got), expected, "{} read otherwise than rapidocr reads it", page["file"]);
        assert_eq!(got["width"], page["width"], "{}", page["file"]);
        assert_eq!(got["text"].as_str().unwrap(), expected.join("\n"));
        assert_eq!(body["usage"]["pages"], 1);
        assert!(body["usage"]["pixels"].as_u64().unwrap() > 0);
        // Every line has a score above the pipeline's minimum and a four-corner box.
        for line in got["lines"].as_array().unwrap() {
            assert!(line["score"].as_f64().unwrap() >= 0.5, "{line}");
            assert_eq!(line["box"].as_array().unwrap().len(), 4, "{line}");
        }
    }
    // The stage models are served like any other: loaded on demand, visible to the admin API.
    for model in ["ocr-det", "ocr-cls", "ocr-rec"] {
        assert_eq!(server.model(model)["state"], "ready", "{model}");
    }
}

#[test]
fn a_pdf_is_read_page_by_page_as_multipart_or_json() {
    let server = Server::start("ocr-pdf", &config(""), &[]);
    let texts: Vec<String> = ["Invoice 2024-117 total due", "Meeting moved to Thursday", "Keep this receipt"]
        .map(String::from)
        .into();
    let doc = pdf::one_line_per_page(&texts, 420, 360);
    let (status, body) = ocr(&server, doc.clone(), "three.pdf", &[("pages", "1,3")]);
    assert_eq!(status, 200, "{body}");
    let pages = body["pages"].as_array().unwrap();
    assert_eq!(pages.iter().map(|p| p["page"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 3]);
    assert_eq!(lines(&pages[0]), [texts[0].clone()]);
    assert_eq!(lines(&pages[1]), [texts[2].clone()]);
    // 420 x 360 points at the pipeline's 150 dpi: 875 x 750, give or take the rasteriser's rounding.
    let size = |p: &Value| (p["width"].as_i64().unwrap(), p["height"].as_i64().unwrap());
    let (w, h) = size(&pages[0]);
    assert!((w - 875).abs() <= 1 && (h - 750).abs() <= 1, "{w} x {h}");

    // The same as JSON, base64, every page, without the classifier, at another dpi.
    let file = base64::engine::general_purpose::STANDARD.encode(&doc);
    let (status, body, _) =
        server.post("/v1/ocr", &json!({"file": file, "use_cls": false, "dpi": 120, "pipeline": "ocr"}));
    assert_eq!(status, 200, "{body}");
    let pages = body["pages"].as_array().unwrap();
    assert_eq!(pages.len(), 3);
    for (page, text) in pages.iter().zip(&texts) {
        assert_eq!(lines(page), std::slice::from_ref(text));
        assert!((size(page).0 - 700).abs() <= 1, "{page}");
    }
    assert_eq!(body["usage"]["runs"][1], 0, "use_cls = false still ran the classifier: {body}");

    // A pipeline without a classifier cannot be asked for one.
    let (status, body) = ocr(&server, doc, "three.pdf", &[("pipeline", "no-cls"), ("use_cls", "true")]);
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("no direction classifier"), "{body}");

    let (status, list) = server.get("/v1/ocr/pipelines");
    assert_eq!(status, 200);
    let names: Vec<&str> =
        list["data"].as_array().unwrap().iter().map(|p| p["id"].as_str().unwrap()).collect();
    assert_eq!(names, ["no-cls", "ocr", "swapped"]);
    // Stages swapped: said at once, by name, not by ONNX Runtime halfway through a page.
    let problem = list["data"][2]["error"].as_str().unwrap_or_default();
    assert!(problem.starts_with("'ocr-rec' (det) is not a detector"), "{}", list["data"][2]);
    assert_eq!(list["data"][1]["error"], Value::Null);
    let small = std::fs::read(fixtures().join("ocr_pages/small.png")).unwrap();
    let (status, body) = ocr(&server, small, "small.png", &[("pipeline", "swapped")]);
    assert_eq!(status, 500, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("is not a detector"), "{body}");
    // Its settings as configured (rapidocr's defaults here), f32s as written.
    let ocr = &list["data"][1];
    assert_eq!(
        (&ocr["limit_type"], &ocr["det_thresh"], &ocr["box_thresh"], &ocr["unclip_ratio"], &ocr["min_score"]),
        (&json!("min"), &json!(0.3), &json!(0.5), &json!(1.6), &json!(0.5)),
        "{ocr}"
    );
}

/// A PNG declaring `width` x `height` pixels with only a sliver of data behind it.
fn lying_png(width: u32, height: u32) -> Vec<u8> {
    fn chunk(out: &mut Vec<u8>, kind: &[u8], data: &[u8]) {
        out.extend((data.len() as u32).to_be_bytes());
        let start = out.len();
        out.extend(kind);
        out.extend(data);
        let crc = crc32(&out[start..]);
        out.extend(crc.to_be_bytes());
    }
    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
            }
        }
        !crc
    }
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend(height.to_be_bytes());
    ihdr.extend([8, 0, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    // A stored (uncompressed) zlib stream of a few zero rows: the rest is missing.
    let rows = vec![0u8; 1024];
    let mut z = vec![0x78, 0x01, 0x01];
    z.extend((rows.len() as u16).to_le_bytes());
    z.extend((!(rows.len() as u16)).to_le_bytes());
    z.extend(&rows);
    chunk(&mut out, b"IDAT", &z);
    chunk(&mut out, b"IEND", &[]);
    out
}

#[test]
fn hostile_documents_get_a_clear_4xx_and_change_nothing() {
    let server = Server::start("ocr-hostile", &config(""), &["--max-request-size", "4MiB"]);
    // The pipeline's series exist from the first scrape, as the models' do (an alert on
    // its errors sees 0, not "no data"), and every series says what it is.
    let metrics = server.metrics();
    for series in [
        "snooze_requests_total{model=\"ocr\",protocol=\"openai\",outcome=\"ok\"} 0",
        "snooze_requests_total{model=\"ocr\",protocol=\"openai\",outcome=\"invalid_input\"} 0",
        "# HELP snooze_requests_total ",
    ] {
        assert!(metrics.lines().any(|l| l.starts_with(series)), "no '{series}' in:\n{metrics}");
    }
    let small = std::fs::read(fixtures().join("ocr_pages/small.png")).unwrap();
    let (status, first) = ocr(&server, small.clone(), "small.png", &[]);
    assert_eq!(status, 200, "{first}");
    // A second read grows ONNX Runtime's arenas and the allocator to their working size.
    let (status, _) = ocr(&server, small.clone(), "small.png", &[]);
    assert_eq!(status, 200);
    let rss = server.rss();
    let text = fixtures().join("ocr_pages/text.pdf");
    let text = std::fs::read(text).unwrap();
    let jpeg = std::fs::read(fixtures().join("ocr_pages/fonts_jpeg.jpg")).unwrap();
    type Case<'a> = (&'a str, Vec<u8>, Vec<(&'a str, &'a str)>, u16, &'a str);
    let cases: Vec<Case> = vec![
        (
            "not a document",
            b"garbage, not an image".to_vec(),
            vec![],
            400,
            "neither a supported image nor a PDF",
        ),
        ("an empty file", Vec::new(), vec![], 400, "empty"),
        ("a truncated PNG", small[..small.len() / 3].to_vec(), vec![], 400, "PNG"),
        // The JPEG decoder would read the first half's lines and pad the rest with grey.
        ("a JPEG cut in half", jpeg[..jpeg.len() / 2].to_vec(), vec![], 400, "ends before the image does"),
        (
            "a 50000 x 50000 PNG",
            lying_png(50_000, 50_000),
            vec![],
            413,
            "over the limit of 40000000 pixels (max_image_pixels)",
        ),
        (
            "a PDF with a password",
            std::fs::read(fixtures().join("ocr_pages/locked.pdf")).unwrap(),
            vec![],
            400,
            "password",
        ),
        ("a PDF that is only a header", b"%PDF-1.7\n%%EOF\n".to_vec(), vec![], 400, "PDF"),
        (
            "61 pages over max_pages 60",
            pdf::one_line_per_page(&vec!["x".to_string(); 61], 100, 100),
            vec![],
            413,
            "at most 60",
        ),
        ("a page past the end", text.clone(), vec![("pages", "2")], 400, "the document has 1 page"),
        (
            "a selection over max_pages",
            pdf::one_line_per_page(&vec!["x".to_string(); 61], 100, 100),
            vec![("pages", "1-61")],
            413,
            "asks for 61 of the document's 61 pages and at most 60",
        ),
        (
            "pipeline and model both",
            small.clone(),
            vec![("pipeline", "ocr"), ("model", "ocr")],
            400,
            "send one",
        ),
        ("a page selection that is not one", text.clone(), vec![("pages", "one")], 400, "pages"),
        ("an unknown pipeline", small.clone(), vec![("pipeline", "nope")], 404, "no OCR pipeline 'nope'"),
        ("a score out of range", small.clone(), vec![("min_score", "7")], 400, "min_score"),
        ("a dpi out of range", text.clone(), vec![("dpi", "100000")], 400, "dpi"),
        ("a dpi too low to read", text.clone(), vec![("dpi", "10")], 400, "dpi 10 is not between 36 and 600"),
        ("a flag that is no flag", small.clone(), vec![("use_cls", "maybe")], 400, "use_cls"),
        ("a misspelt option", text.clone(), vec![("page", "1")], 400, "unknown field 'page'"),
        (
            "an option given twice",
            text.clone(),
            vec![("pages", "1"), ("pages", "2")],
            400,
            "the form field 'pages' is given more than once",
        ),
    ];
    for (what, bytes, fields, expected, needle) in cases {
        let (status, body) = ocr(&server, bytes, "doc", &fields);
        assert_eq!(status, expected, "{what}: {body}");
        let message =
            body["error"]["message"].as_str().unwrap_or_else(|| panic!("{what}: no message: {body}"));
        assert!(message.contains(needle), "{what}: '{message}' does not say '{needle}'");
        // A refused option is named, as OpenAI's API names the parameter at fault (the
        // second of two that conflict).
        // A file that cannot be read is the `file` parameter's fault.
        let param = fields.last().map_or("file", |(option, _)| *option);
        assert_eq!(body["error"]["param"], param, "{what}: {body}");
    }
    // The document sent under another field name is pointed at `file`.
    let mut misnamed = audio::form(&[], Some(("small.png", &small)));
    let at = misnamed.body.windows(11).position(|w| w == b"name=\"file\"").unwrap();
    misnamed.body.splice(at..at + 11, b"name=\"image\"".iter().copied());
    let resp = client()
        .post(server.url("/v1/ocr"))
        .header("content-type", misnamed.content_type)
        .body(misnamed.body)
        .send()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let body: Value = resp.json().unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("send the document as `file`"), "{body}");
    // Bodies that are not an OCR request at all.
    let resp = client().post(server.url("/v1/ocr")).body("plain").send().unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let (status, body, _) = server.post("/v1/ocr", &json!({"file": "@@@"}));
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "file", "{body}");
    let (status, body, _) = server.post("/v1/ocr", &json!({"file": "", "colour": true}));
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("colour"), "{body}");
    assert_eq!(body["error"]["param"], "colour", "{body}");
    // A repeated JSON member is refused as the repeated form field is (a JSON map would
    // keep the last and read pages 2-9 of a request that also said 1).
    let resp = client()
        .post(server.url("/v1/ocr"))
        .header("content-type", "application/json")
        .body(r#"{"file": "", "pages": "1", "pages": "2-9"}"#)
        .send()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let body: Value = resp.json().unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("'pages' is given more than once"), "{body}");
    assert_eq!(body["error"]["param"], "pages", "{body}");
    // Base64 as people paste it is read: wrapped at 76 columns as `base64` prints it, and
    // as a data: URL; options as strings or numbers alike.
    let encoded = base64::engine::general_purpose::STANDARD.encode(&small);
    let wrapped: Vec<&str> = encoded.as_bytes().chunks(76).map(|c| std::str::from_utf8(c).unwrap()).collect();
    // Media types are case-insensitive.
    // And as browsers and Python's urlsafe_b64encode write it: the URL-safe alphabet,
    // `=` padding left off; a data: URL's scheme in any case.
    let url_safe = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&small);
    assert!(url_safe.contains(['-', '_']) && encoded.ends_with('='), "the fixture shows both");
    for (file, content_type) in [
        (wrapped.join("\n"), "application/json"),
        (format!("data:image/png;base64,{encoded}"), "Application/JSON"),
        (url_safe, "application/json"),
        (format!("DATA:image/png;base64,{}", encoded.trim_end_matches('=')), "application/json"),
    ] {
        let request = json!({"file": file, "min_score": "0.5", "pages": null});
        let resp = client()
            .post(server.url("/v1/ocr"))
            .header("content-type", content_type)
            .body(request.to_string())
            .send()
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        // Named as every answer about a model is, for a proxy that routes by it.
        assert_eq!(resp.headers()["x-snooze-model"], "ocr");
        let body: Value = resp.json().unwrap();
        assert_eq!(body["pages"], first["pages"]);
    }
    // What is not base64 is named as the user wrote it, not by an offset into a copy.
    for (file, says) in [("iVBOR$w0K", "'$', which is not a base64 character"), ("iVBORw0KG", "cut short")] {
        let resp = client()
            .post(server.url("/v1/ocr"))
            .header("content-type", "application/json")
            .body(json!({ "file": file }).to_string())
            .send()
            .unwrap();
        assert_eq!(resp.status().as_u16(), 400);
        let body: Value = resp.json().unwrap();
        assert!(body["error"]["message"].as_str().unwrap().contains(says), "{file}: {body}");
        assert_eq!(body["error"]["param"], "file", "{body}");
    }
    // The detector alone over KServe: its metadata takes any height and width, but under
    // 32 px a side its skip connections no longer line up; the request's fault, a 400.
    let tiny = json!({"inputs": [{"name": "x", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": vec![0.5; 768]}]});
    let (status, body, _) = server.post("/v2/models/ocr-det/infer", &tiny);
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().starts_with("model 'ocr-det' rejected the request"), "{body}");
    let form = audio::form(&[("pipeline", "ocr")], None);
    let resp = client()
        .post(server.url("/v1/ocr"))
        .header("content-type", form.content_type)
        .body(form.body)
        .send()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);

    // Nothing changed: no request's memory stayed behind, and the same page reads the same.
    let after = server.rss();
    assert!(after < rss + (64 << 20), "the refused documents left memory behind: {rss} -> {after} bytes");
    let (status, again) = ocr(&server, small, "small.png", &[]);
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["pages"], first["pages"]);
    let (_, memory) = server.get("/admin/memory/stats");
    assert_eq!(memory["requests_in_flight"]["bytes"], 0, "{memory}");
}

#[test]
fn a_long_pdf_is_read_in_page_batches_whose_memory_does_not_grow_with_its_length() {
    let server = Server::start("ocr-long", &config("page_batch = 4"), &[]);
    let page = |i: usize| format!("Page {i} of the annual report");
    let document = |n: usize| pdf::one_line_per_page(&(1..=n).map(page).collect::<Vec<_>>(), 360, 360);
    let read = |n: usize| {
        let (status, body) = ocr(&server, document(n), "report.pdf", &[("use_cls", "False")]);
        assert_eq!(status, 200, "{body}");
        let pages = body["pages"].as_array().unwrap().clone();
        assert_eq!(pages.len(), n);
        for (i, p) in pages.iter().enumerate() {
            assert_eq!(p["page"].as_u64(), Some(i as u64 + 1));
            assert_eq!(lines(p), [page(i + 1)], "page {}", i + 1);
        }
        peak_rss(&server)
    };
    // The first document loads the models and grows ONNX Runtime's arenas to a batch's
    // shapes; after it, a document of 8 pages and one of 24 go through the same batches.
    read(4);
    let eight = read(8);
    let twenty_four = read(24);
    // A page of 360 x 360 points is 750 x 750 pixels: ~1.7 MB as RGB, ~7 MB as the
    // detector's input and ~130 MB of its working set (240 bytes a pixel), so holding even
    // one more page at once would add over 96 MiB, and 16 more hundreds. The allocator
    // alone moves the peak by up to ~50 MiB from one document to the next (measured with
    // the stages on the shared pool: +21-44 MiB; on pools of their own, whose threads
    // each keep an arena: +13-50 MiB).
    assert!(
        twenty_four < eight + (96 << 20),
        "24 pages peaked at {} MiB, 8 pages at {} MiB: the pages are not read in bounded batches",
        twenty_four >> 20,
        eight >> 20
    );
}

#[test]
fn a_document_being_read_at_sigterm_is_read_to_the_end() {
    // Its stages are requests of their own to the core: the detector ran, then the
    // shutdown unloaded the idle classifier and recogniser and refused the document's
    // next stage (a 503 mid-document on every rolling deploy).
    let server = Server::start("ocr-sigterm", &config(""), &[]);
    let page = std::fs::read(fixtures().join("ocr_pages/columns.png")).unwrap();
    let (status, warm) = ocr(&server, page.clone(), "columns.png", &[]);
    assert_eq!(status, 200, "{warm}");
    let base = server.base.clone();
    let reading = thread::spawn(move || audio::post_ocr(&base, &page, "columns.png", &[]));
    server.wait_for("the detector to run", |s| s.model("ocr-det")["leases"].as_u64() == Some(1));
    let exit = server.terminate();
    let (status, body) = reading.join().unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(lines(&body["pages"][0]), lines(&warm["pages"][0]));
    assert!(exit.success(), "{exit:?}");
}
