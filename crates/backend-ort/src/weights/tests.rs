//! The cache's entries: which are whose, and which go.

use super::*;

/// An empty folder of this test's own under the temp dir, with its `ort-cache` in it.
fn scratch(tag: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("snooze-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = dir.join("ort-cache");
    std::fs::create_dir_all(&cache).unwrap();
    (dir, cache)
}

/// Asserts that every path in `paths` exists (`true`) or does not (`false`).
fn assert_exist<'a>(paths: impl IntoIterator<Item = &'a PathBuf>, exist: bool, why: &str) {
    for path in paths {
        assert_eq!(path.exists(), exist, "{} {why}", path.display());
    }
}

/// The three entries `onnx` can have in `cache`, as files and folders of some bytes.
fn entries(onnx: &Path, cache: &Path, runtime: &Path) -> [PathBuf; 3] {
    entries_named(&cache_stem(onnx, runtime), cache)
}

/// The three entries of the stem `stem` in `cache`, made as [`entries`] makes them.
fn entries_named(stem: &str, cache: &Path) -> [PathBuf; 3] {
    let [ort, mapped, prepacked] =
        [".ort", ".mapped", ".prepacked"].map(|suffix| cache.join(format!("{stem}{suffix}")));
    std::fs::write(&ort, b"ort").unwrap();
    for dir in [&mapped, &prepacked] {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("model.onnx"), b"graph").unwrap();
        std::fs::write(dir.join("model.data"), b"weights").unwrap();
    }
    [ort, mapped, prepacked]
}

#[test]
fn collecting_removes_the_copies_of_a_replaced_model_version_and_nothing_else() {
    let (dir, cache) = scratch("replaced");
    let runtime = Path::new("/opt/onnxruntime/libonnxruntime.so.1.32.0");
    let model = |name: &str, bytes: &[u8]| {
        let onnx = dir.join(name).join("model.onnx");
        std::fs::create_dir_all(onnx.parent().unwrap()).unwrap();
        std::fs::write(&onnx, bytes).unwrap();
        onnx
    };
    let (replaced, kept, gone) = (model("a", b"version 1"), model("b", b"b"), model("c", b"c"));
    let replaced_entries = entries(&replaced, &cache, runtime);
    let mut kept_entries = vec![cache.join("made-before-sources-0123456789abcdef.ort")];
    std::fs::write(&kept_entries[0], b"ort").unwrap();
    for onnx in [&kept, &gone] {
        kept_entries.extend(entries(onnx, &cache, runtime));
    }
    for onnx in [&replaced, &kept, &gone] {
        remember_source(onnx, &cache, runtime);
    }
    let source = cache.join(format!("{}.source", cache_stem(&replaced, runtime)));
    kept_entries.push(cache.join(format!("{}.source", cache_stem(&kept, runtime))));
    kept_entries.push(cache.join(format!("{}.source", cache_stem(&gone, runtime))));
    // Its file deleted, a model keeps its copies (another process may see the file).
    std::fs::remove_file(&gone).unwrap();

    collect_replaced(&cache);
    assert_exist(
        replaced_entries.iter().chain(&kept_entries).chain([&source]),
        true,
        "removed while current",
    );
    std::fs::write(&replaced, b"version 2, a new size").unwrap();
    collect_replaced(&cache);
    assert_exist(replaced_entries.iter().chain([&source]), false, "of a replaced version kept");
    assert_exist(&kept_entries, true, "removed");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_copies_of_an_earlier_form_go_and_those_of_this_one_stay() {
    let (dir, cache) = scratch("earlier-form");
    let runtime = Path::new("/opt/onnxruntime/libonnxruntime.so.1.32.0");
    let onnx = dir.join("a/model.onnx");
    std::fs::create_dir_all(onnx.parent().unwrap()).unwrap();
    std::fs::write(&onnx, b"graph").unwrap();
    let current = entries(&onnx, &cache, runtime);
    remember_source(&onnx, &cache, runtime);
    // What a version before form 2 left: the same model, noted with two lines.
    let earlier = entries_named("mlp-0123456789abcdef", &cache);
    let old_source = cache.join("mlp-0123456789abcdef.source");
    let path = std::path::absolute(&onnx).unwrap();
    std::fs::write(&old_source, format!("{}\n{}\n", path.display(), model_fingerprint(&onnx))).unwrap();
    collect_replaced(&cache);
    assert_exist(earlier.iter().chain([&old_source]), false, "of an earlier form kept");
    assert_exist(&current, true, "of this form removed");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model named through a link whose target has another name (as `make prepare`
/// links rapidocr's files) keeps its copies; pointed at a new file, it loses them.
#[cfg(unix)]
#[test]
fn a_linked_model_keeps_its_copies_until_the_link_points_elsewhere() {
    let (dir, cache) = scratch("replaced-link");
    let runtime = Path::new("/opt/onnxruntime/libonnxruntime.so.1.32.0");
    std::fs::create_dir_all(dir.join("wheel")).unwrap();
    std::fs::create_dir_all(dir.join("ocr-det")).unwrap();
    let (v1, v2) = (dir.join("wheel/PP-OCRv6_det_small.onnx"), dir.join("wheel/PP-OCRv7_det.onnx"));
    std::fs::write(&v1, b"version 1").unwrap();
    std::fs::write(&v2, b"version 2, another size").unwrap();
    let onnx = dir.join("ocr-det/model.onnx");
    std::os::unix::fs::symlink(&v1, &onnx).unwrap();
    let made = entries(&onnx, &cache, runtime);
    remember_source(&onnx, &cache, runtime);
    let source = cache.join(format!("{}.source", cache_stem(&onnx, runtime)));
    for _ in 0..2 {
        collect_replaced(&cache);
        for path in made.iter().chain([&source]) {
            assert!(path.exists(), "{} removed while the link's file is current", path.display());
        }
    }
    // A second model linked to the same file keeps its copies when the first link
    // is pointed elsewhere.
    std::fs::create_dir_all(dir.join("other/ocr-det")).unwrap();
    let other = dir.join("other/ocr-det/model.onnx");
    std::os::unix::fs::symlink(&v1, &other).unwrap();
    let others = entries(&other, &cache, runtime);
    remember_source(&other, &cache, runtime);
    let other_source = cache.join(format!("{}.source", cache_stem(&other, runtime)));
    std::fs::remove_file(&onnx).unwrap();
    std::os::unix::fs::symlink(&v2, &onnx).unwrap();
    collect_replaced(&cache);
    for path in made.iter().chain([&source]) {
        assert!(!path.exists(), "{} of the file the link left kept", path.display());
    }
    for path in others.iter().chain([&other_source]) {
        assert!(path.exists(), "{} of a link still at the file removed", path.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_repeated_failure_is_warned_of_once_per_key() {
    let key = format!("test key {}", std::process::id());
    assert!(first_time(&key));
    assert!(!first_time(&key), "the second time is a debug line");
    assert!(first_time(&format!("{key}, another entry")));
}

#[test]
fn new_external_data_is_a_new_model_version_and_its_old_copies_go() {
    use crate::proto::{bytes_field as ld, varint_field as varint};
    let (dir, cache) = scratch("replaced-data");
    std::fs::create_dir_all(dir.join("m")).unwrap();
    let (onnx, data) = (dir.join("m/model.onnx"), dir.join("m/w.bin"));
    // A graph whose one initializer lives in `w.bin` (data_location = EXTERNAL).
    let location = [ld(1, b"location"), ld(2, b"w.bin")].concat();
    let tensor = [ld(8, b"W"), ld(13, &location), varint(14, 1)].concat();
    std::fs::write(&onnx, [varint(1, 8), ld(7, &ld(5, &tensor))].concat()).unwrap();
    std::fs::write(&data, b"weights, version 1").unwrap();
    let runtime = Path::new("/opt/onnxruntime/libonnxruntime.so.1.32.0");
    let stem = cache_stem(&onnx, runtime);
    let old = entries(&onnx, &cache, runtime);
    remember_source(&onnx, &cache, runtime);
    collect_replaced(&cache);
    assert!(old.iter().all(|p| p.exists()), "the current version's copies are kept");
    // New weights, the .onnx untouched: a new version, and the old copies are stale.
    std::fs::write(&data, b"weights, version 2, longer").unwrap();
    assert_ne!(cache_stem(&onnx, runtime), stem, "the old copies would serve the old weights");
    collect_replaced(&cache);
    for path in old.iter().chain([&cache.join(format!("{stem}.source"))]) {
        assert!(!path.exists(), "{} of the old weights kept", path.display());
    }
    // Without external data, the file's own fingerprint: copies made before stay valid.
    std::fs::write(&onnx, [varint(1, 8), ld(7, &ld(1, b"node"))].concat()).unwrap();
    assert_eq!(model_fingerprint(&onnx), snooze_core::learned::fingerprint(&onnx));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_mapped_copy_notes_its_source_and_goes_when_a_new_version_is_copied() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mlp-10m/model.onnx");
    assert!(demo.is_file(), "{} is missing: run `make prepare`", demo.display());
    let (dir, cache) = scratch("replaced-copy");
    let onnx = dir.join("mlp/model.onnx");
    std::fs::create_dir_all(onnx.parent().unwrap()).unwrap();
    std::fs::copy(&demo, &onnx).unwrap();
    let runtime = Path::new("/opt/onnxruntime/libonnxruntime.so.1.32.0");
    let copy = mapped_copy(&onnx, &cache, runtime).unwrap().expect("inline weights: a mapped copy");
    let stem = cache_stem(&onnx, runtime);
    let source = cache.join(format!("{stem}.source"));
    let noted = std::fs::read_to_string(&source).unwrap();
    let noted_path = std::path::absolute(&onnx).unwrap();
    assert_eq!(
        noted,
        format!("{}\n{}\n{FORM_LINE}\n", noted_path.display(), snooze_core::learned::fingerprint(&onnx))
    );
    // A new version of the model at the same path (the same graph and weights, one
    // byte longer: an empty field at the end): its first copy removes the old one.
    let mut bytes = std::fs::read(&onnx).unwrap();
    bytes.extend([0x52, 0x00]); // field 10 (a string), empty
    std::fs::write(&onnx, bytes).unwrap();
    let new = mapped_copy(&onnx, &cache, runtime).unwrap().expect("a copy of the new version");
    assert!(!copy.exists() && !cache.join(format!("{stem}.mapped")).exists() && !source.exists());
    assert!(new.is_file() && new != copy);
    assert!(cache.join(format!("{}.source", cache_stem(&onnx, runtime))).is_file());
    let _ = std::fs::remove_dir_all(&dir);
}
