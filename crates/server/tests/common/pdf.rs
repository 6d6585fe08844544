//! PDFs made in the test from page content streams, so a document's page count, page
//! size and text are whatever a test needs. Fonts `/F1`, `/F2` and `/F3` are Helvetica
//! (one of PDF's standard fonts: the rasteriser needs nothing embedded).

#![allow(dead_code)]

/// A PDF whose pages are `contents` (one content stream each), `width` x `height` points.
pub fn pdf(contents: &[String], width: u32, height: u32) -> Vec<u8> {
    let n = contents.len();
    let mut objects = vec![
        "<< /Type /Catalog /Pages 2 0 R >>".to_string(),
        format!(
            "<< /Type /Pages /Kids [{}] /Count {n} >>",
            (0..n).map(|i| format!("{} 0 R", 4 + 2 * i)).collect::<Vec<_>>().join(" ")
        ),
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>".to_string(),
    ];
    for (i, content) in contents.iter().enumerate() {
        objects.push(format!(
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 {width} {height}] /Contents {} 0 R \
             /Resources << /Font << /F1 3 0 R /F2 3 0 R /F3 3 0 R >> >> >>",
            5 + 2 * i
        ));
        objects.push(format!("<< /Length {} >>\nstream\n{content}\nendstream", content.len()));
    }
    let mut out = b"%PDF-1.4\n".to_vec();
    let mut offsets = Vec::new();
    for (i, o) in objects.iter().enumerate() {
        offsets.push(out.len());
        out.extend(format!("{} 0 obj\n{o}\nendobj\n", i + 1).bytes());
    }
    let xref = out.len();
    out.extend(format!("xref\n0 {}\n0000000000 65535 f \n", objects.len() + 1).bytes());
    for o in offsets {
        out.extend(format!("{o:010} 00000 n \n").bytes());
    }
    out.extend(
        format!("trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n", objects.len() + 1).bytes(),
    );
    out
}

/// A PDF with one line of 20-point Helvetica per page.
pub fn one_line_per_page(lines: &[String], width: u32, height: u32) -> Vec<u8> {
    let contents: Vec<String> =
        lines.iter().map(|text| format!("BT /F1 20 Tf 30 {} Td ({text}) Tj ET", height / 2)).collect();
    pdf(&contents, width, height)
}
