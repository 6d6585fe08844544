//! The three ways of holding a model's weights give the same outputs; `compact` and
//! `mapped` are built from an ORT-format copy cached outside the user's files, made by
//! `prepare` — a load never converts with the runtime: before the copy exists it loads
//! the mapped copy (the `.onnx` with its weights moved to a mapped data file, which the
//! load makes), or the `.onnx` where there is no cache.

#![allow(clippy::unwrap_used)]

mod common;

use common::{backend, cache_dir, cpu, max_abs, max_abs_diff, model};
use snooze_core::{Backend, LoadSpec, Tensor, TensorData, Weights};

fn spec(name: &str, weights: Weights) -> LoadSpec {
    LoadSpec { weights, ..cpu(name, model(name)) }
}

fn floats(out: &[Tensor]) -> Vec<f32> {
    match &out[0].data {
        TensorData::Fp32(v) => v.clone(),
        other => panic!("{other:?}"),
    }
}

/// The model's reference rows, an 8-row batch of its first, scaled row by row, and that
/// row alone.
fn inputs() -> Vec<Vec<Tensor>> {
    let text = std::fs::read_to_string(model("mlp-100m-1").join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let x: Vec<f32> =
        v["input"]["x"].as_array().unwrap().iter().map(|f| f.as_f64().unwrap() as f32).collect();
    let rows = x.len() / 256;
    let eight: Vec<f32> =
        (0..8).flat_map(|r| x[..256].iter().map(move |f| f * (1.0 + r as f32 / 8.0))).collect();
    let first = x[..256].to_vec();
    vec![
        vec![Tensor::new("x", vec![rows as i64, 256], TensorData::Fp32(x))],
        vec![Tensor::new("x", vec![8, 256], TensorData::Fp32(eight))],
        vec![Tensor::new("x", vec![1, 256], TensorData::Fp32(first))],
    ]
}

#[test]
fn every_profile_gives_the_same_outputs() {
    let cache = cache_dir("outputs");
    let b = backend().with_cache_dir(cache.path());
    let run = |w: Weights| {
        let m = b.load(&spec("mlp-100m-1", w)).unwrap();
        inputs().iter().map(|i| floats(&m.infer(i, &[]).unwrap())).collect::<Vec<_>>()
    };
    let prepacked = run(Weights::Prepacked);
    // Not converted yet: the lean profiles serve from the mapped copy, without prepacking,
    // its weights mapped (counted in the footprint from the start); without a cache, from
    // the .onnx.
    let m = b.load(&spec("mlp-100m-1", Weights::Mapped)).unwrap();
    let file = std::fs::metadata(model("mlp-100m-1").join("model.onnx")).unwrap().len();
    assert!(
        m.mapped_bytes() >= file - (1 << 20) && m.mapped_bytes() <= file + (1 << 20),
        "{}",
        m.mapped_bytes()
    );
    drop(m);
    let unconverted = run(Weights::Mapped);
    let from_onnx = {
        let m = backend().load(&spec("mlp-100m-1", Weights::Mapped)).unwrap();
        assert_eq!(m.mapped_bytes(), 0, "the runtime's own copy");
        inputs().iter().map(|i| floats(&m.infer(i, &[]).unwrap())).collect::<Vec<_>>()
    };
    b.prepare(&spec("mlp-100m-1", Weights::Mapped)).unwrap();
    let compact = run(Weights::Compact);
    let mapped = run(Weights::Mapped);
    assert_eq!(compact, mapped, "the same kernels over the same bytes: bit for bit");
    // The mapped copy, whose MatMul weights are stored as panels (no run packs them by
    // strides), runs as the ORT-format copy made from it, bit for bit.
    assert_eq!(unconverted, mapped, "an unconverted mapped load runs as its converted copy does");
    let copies: Vec<_> = std::fs::read_dir(cache.path()).unwrap().map(|e| e.unwrap().path()).collect();
    let copy = copies.iter().find(|p| p.extension().is_some_and(|e| e == "mapped")).unwrap();
    assert!(copy.join("PANELS").is_file(), "the MLP's mapped copy has its weights as panels: {copies:?}");
    // Other kernels, other summation order (the .onnx without prepacking, the prepacked
    // copy made from the .onnx): within 1e-5 of the output's scale, and not bit for bit
    // (or the comparisons would prove nothing).
    assert_ne!(from_onnx, mapped, "the .onnx runs the MatMuls panel by panel");
    // The prepacked copy is made from the .onnx, not from the paneled copy: it runs as the
    // .onnx prepacked at load does (the original layout prepacked is the fastest).
    let default = {
        let m = backend().load(&spec("mlp-100m-1", Weights::Prepacked)).unwrap();
        inputs().iter().map(|i| floats(&m.infer(i, &[]).unwrap())).collect::<Vec<_>>()
    };
    b.prepare(&spec("mlp-100m-1", Weights::Prepacked)).unwrap();
    assert_eq!(entries(cache.path(), ".prepacked").len(), 1, "the prepacked copy was made");
    assert_eq!(run(Weights::Prepacked), default, "the prepacked copy multiplies as the .onnx prepacked does");
    assert_eq!(prepacked, default);
    assert_ne!(unconverted, prepacked, "prepacking changes the summation order on this model");
    for other in [&prepacked, &from_onnx] {
        for (p, c) in other.iter().zip(&compact) {
            let (scale, worst) = (max_abs(p), max_abs_diff(p, c));
            assert!(worst <= 1e-5 * scale, "compact differs by {worst:e}, output scale {scale}");
        }
    }
    // And the numpy reference.
    let text = std::fs::read_to_string(model("mlp-100m-1").join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let want: Vec<f32> =
        v["output"]["y"].as_array().unwrap().iter().map(|f| f.as_f64().unwrap() as f32).collect();
    let diff = max_abs_diff(&want, &mapped[0]);
    assert!(diff <= 1e-4, "mapped differs from numpy by {diff}");
}

/// The peak of a conversion from the `.onnx` in `folder`.
fn from_onnx_of(folder: &std::path::Path) -> u64 {
    snooze_backend_ort::estimate::conversion_peak_of(
        std::fs::metadata(folder.join("model.onnx")).unwrap().len(),
    )
}

#[test]
fn the_ort_format_copy_is_cached_once_outside_the_users_files() {
    let dir = cache_dir("once");
    let b = backend().with_cache_dir(dir.path());
    let folder = model("mlp-10m");
    let before: Vec<_> = std::fs::read_dir(&folder).unwrap().map(|e| e.unwrap().file_name()).collect();
    let file = std::fs::metadata(folder.join("model.onnx")).unwrap().len();
    // Converted from the mapped copy: 1.7x the model and a floor, not the 2.7x from the .onnx.
    let peak = b.preparation(&folder, Weights::Mapped).expect("a conversion is pending");
    let from_onnx = snooze_backend_ort::estimate::conversion_peak_of(file);
    assert!(peak > file && peak < from_onnx, "the conversion's peak: {peak} for a {file}-byte model");
    assert_eq!(
        backend().with_cache_dir(cache_dir("no-copy").path()).preparation(&folder, Weights::Mapped),
        Some(peak)
    );
    // Its prepacked copy is made from the .onnx, at the .onnx's peak, as is every model's
    // whose mapped copy stores weights as panels (its 5 MiB matrices), before and after
    // the mapped copy exists; a model without (the OCR detector: convolutions) has its
    // prepacked copy made from its mapped copy too.
    assert_eq!(b.preparation(&folder, Weights::Prepacked), Some(from_onnx));
    let det = model("ocr-det");
    let plain = backend().with_cache_dir(cache_dir("once-det").path());
    assert!(plain.preparation(&det, Weights::Prepacked).is_some_and(|p| p < from_onnx_of(&det)));
    assert_eq!(plain.preparation(&det, Weights::Prepacked), plain.preparation(&det, Weights::Mapped));
    let big = model("mlp-100m-1");
    let big_file = std::fs::metadata(big.join("model.onnx")).unwrap().len();
    let big_peak = snooze_backend_ort::estimate::conversion_peak_of(big_file);
    let big_dir = cache_dir("once-big");
    let b2 = backend().with_cache_dir(big_dir.path());
    assert_eq!(b2.preparation(&big, Weights::Prepacked), Some(big_peak));
    assert!(b2.preparation(&big, Weights::Mapped).is_some_and(|p| p < big_peak));
    drop(b2.load(&spec("mlp-100m-1", Weights::Mapped)).unwrap());
    assert_eq!(b2.preparation(&big, Weights::Prepacked), Some(big_peak), "the made copy has panels");
    drop(b.load(&spec("mlp-10m", Weights::Mapped)).unwrap());
    let listed = || {
        // Each copy's `.source` note (which model version it was made from) is checked
        // apart; `.lock-*` is this process's proof of life for its half-made entries.
        let mut v: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_none_or(|e| e != "source"))
            .filter(|p| !p.file_name().unwrap().to_str().unwrap().starts_with(".lock-"))
            .collect();
        v.sort();
        v
    };
    let cached = listed();
    assert_eq!(cached.len(), 1, "a load makes the mapped copy and converts nothing: {cached:?}");
    assert!(cached[0].extension().is_some_and(|e| e == "mapped"), "{cached:?}");
    let data = std::fs::metadata(cached[0].join("model.data")).unwrap().len();
    let graph = std::fs::metadata(cached[0].join("model.onnx")).unwrap().len();
    assert!(data >= file - 4096 && graph < 4096, "data {data}, graph {graph}, model {file}");
    let note = std::fs::read_to_string(cached[0].with_extension("source")).expect("the copy's source note");
    // The path as configured, made absolute, its links not followed.
    let onnx = std::path::absolute(folder.join("model.onnx")).unwrap();
    assert!(note.starts_with(&format!("{}\n", onnx.display())), "{note}");
    b.prepare(&spec("mlp-10m", Weights::Mapped)).unwrap();
    assert_eq!(b.preparation(&folder, Weights::Mapped), None, "nothing pending once converted");
    let cached = listed();
    assert_eq!(cached.len(), 2, "{cached:?}");
    let ort = cached.iter().find(|p| p.extension().is_some_and(|e| e == "ort")).expect("the ORT-format copy");
    let made = std::fs::metadata(ort).unwrap().modified().unwrap();
    b.prepare(&spec("mlp-10m", Weights::Compact)).unwrap();
    drop(b.load(&spec("mlp-10m", Weights::Compact)).unwrap());
    assert_eq!(std::fs::metadata(ort).unwrap().modified().unwrap(), made, "converted once");
    assert_eq!(listed().len(), 2);
    let after: Vec<_> = std::fs::read_dir(&folder).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(before, after, "the model's folder is untouched");
}

#[test]
fn what_a_killed_conversion_left_in_the_cache_goes_at_the_next_load() {
    // A conversion killed mid-way (an out-of-memory kill) leaves its half-written copy under
    // a name no later attempt reuses; the first load that writes to the cache removes it.
    let dir = cache_dir("stale");
    std::fs::create_dir_all(&dir).unwrap();
    let stale = dir.path().join("mlp-10m-0123456789abcdef.ort.tmp-2147483646-0"); // no such pid
    std::fs::write(&stale, vec![0u8; 4096]).unwrap();
    drop(backend().with_cache_dir(dir.path()).load(&spec("mlp-10m", Weights::Mapped)).unwrap());
    assert!(!stale.exists(), "a stopped process's half-written copy is removed");
    let mut left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with(".lock-"))
        .collect();
    left.sort();
    assert_eq!(left.len(), 2, "the mapped copy and its source note alone: {left:?}");
    assert!(left[0].ends_with(".mapped") && left[1].ends_with(".source"), "{left:?}");
}

#[test]
fn a_cache_that_cannot_be_written_is_a_clear_error_and_the_model_still_loads() {
    let b = backend().with_cache_dir("/proc/snooze-cannot-write-here");
    let e = b.prepare(&spec("mlp-10m", Weights::Mapped)).unwrap_err().to_string();
    assert!(
        e.contains("mlp-10m") && e.contains("mapped") && e.contains("/proc/snooze-cannot-write-here"),
        "{e}"
    );
    assert!(b.load(&spec("mlp-10m", Weights::Mapped)).is_ok(), "served from the .onnx");
    // Without any cache directory, the lean profiles say what they need to be prepared.
    let e = backend().prepare(&spec("mlp-10m", Weights::Compact)).unwrap_err().to_string();
    assert!(e.contains("cache directory"), "{e}");
    assert!(backend().load(&spec("mlp-10m", Weights::Compact)).is_ok(), "served from the .onnx");
}

#[test]
fn mapped_and_compact_estimates_are_about_the_weights() {
    let cache = cache_dir("estimates");
    let b = backend().with_cache_dir(cache.path());
    let path = model("mlp-100m-1");
    let file = std::fs::metadata(path.join("model.onnx")).unwrap().len();
    let prepacked = b.estimate(&path, Weights::Prepacked).steady_bytes.unwrap();
    // Without a cache, a lean model loads as the .onnx does; with one, its mapped copy.
    let no_cache = backend().estimate(&path, Weights::Mapped);
    assert_eq!(no_cache.steady_bytes, Some(prepacked), "{}", no_cache.derivation);
    assert!(no_cache.derivation.contains("from the .onnx meanwhile"), "{}", no_cache.derivation);
    let before = b.estimate(&path, Weights::Mapped);
    assert!(before.derivation.contains("mapped copy meanwhile"), "{}", before.derivation);
    b.prepare(&spec("mlp-100m-1", Weights::Mapped)).unwrap();
    let lean = b.estimate(&path, Weights::Mapped).steady_bytes.unwrap();
    assert_eq!(before.steady_bytes, Some(lean), "the mapped copy holds what the converted one does");
    assert!(lean < prepacked && lean >= file, "{lean} vs {prepacked}, file {file}");
}

#[test]
fn a_broken_mapped_copy_is_replaced_by_the_onnx_and_made_again() {
    let dir = cache_dir("broken-copy");
    let b = backend().with_cache_dir(dir.path());
    let run = |m: &dyn snooze_core::LoadedModel| floats(&m.infer(&inputs()[0], &[]).unwrap());
    let m = b.load(&spec("mlp-10m", Weights::Mapped)).unwrap();
    assert!(m.mapped_bytes() > 0, "served from its mapped copy");
    let first = run(m.as_ref());
    drop(m);
    let copy = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "mapped"))
        .unwrap();
    // Cut short (a full disk, a copy damaged on disk): the runtime refuses it.
    std::fs::OpenOptions::new().write(true).open(copy.join("model.data")).unwrap().set_len(4096).unwrap();
    let m = b.load(&spec("mlp-10m", Weights::Mapped)).expect("served from the .onnx");
    assert_eq!(m.mapped_bytes(), 0, "the runtime's own copy of the .onnx");
    let from_onnx = run(m.as_ref());
    drop(m);
    assert!(!copy.exists(), "the broken copy is gone");
    let m = b.load(&spec("mlp-10m", Weights::Mapped)).unwrap();
    assert!(m.mapped_bytes() > 0 && copy.join("model.data").is_file(), "made again by the next load");
    // Its 5 MiB weights are stored as panels (see `panels` in the crate): the copy made
    // again runs as the first did, bit for bit, and as the .onnx does, to rounding.
    assert!(copy.join("PANELS").is_file());
    let again = run(m.as_ref());
    assert_eq!(again, first);
    let (scale, worst) = (max_abs(&from_onnx), max_abs_diff(&from_onnx, &again));
    assert!(
        worst <= 1e-5 * scale && worst > 0.0,
        "differs by {worst:e} from the .onnx, output scale {scale}"
    );
}

/// The cache entries of `dir` whose names end with `suffix`.
fn entries(dir: &std::path::Path, suffix: &str) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_str().is_some_and(|s| s.ends_with(suffix)))
        .collect()
}

#[test]
fn a_broken_prepacked_or_ort_format_copy_is_removed_and_the_onnx_loads() {
    let dir = cache_dir("broken-converted");
    let b = backend().with_cache_dir(dir.path());
    let run = |m: &dyn snooze_core::LoadedModel| floats(&m.infer(&inputs()[0], &[]).unwrap());
    let expected = run(backend().load(&spec("mlp-10m", Weights::Prepacked)).unwrap().as_ref());
    // A prepacked copy whose data file was cut short (a full disk, a damaged volume):
    // every load failed with the runtime's error, naming the intact .onnx.
    b.prepare(&spec("mlp-10m", Weights::Prepacked)).unwrap();
    let [copy] = entries(dir.path(), ".prepacked").try_into().unwrap();
    std::fs::OpenOptions::new().write(true).open(copy.join("model.data")).unwrap().set_len(4096).unwrap();
    let m = b.load(&spec("mlp-10m", Weights::Prepacked)).expect("served from the .onnx");
    assert_eq!(run(m.as_ref()), expected);
    assert!(!copy.exists(), "the broken copy is gone, so the next preparation makes it again");
    b.prepare(&spec("mlp-10m", Weights::Prepacked)).unwrap();
    assert!(copy.join("model.onnx").is_file());
    // The same for the ORT-format file of `compact` and `mapped`.
    b.prepare(&spec("mlp-10m", Weights::Compact)).unwrap();
    let [ort] = entries(dir.path(), ".ort").try_into().unwrap();
    std::fs::OpenOptions::new().write(true).open(&ort).unwrap().set_len(4096).unwrap();
    for weights in [Weights::Compact, Weights::Mapped] {
        let m = b.load(&spec("mlp-10m", weights)).expect("served without the ORT-format file");
        let diff = max_abs_diff(&run(m.as_ref()), &expected);
        assert!(diff < 1e-4, "{weights:?}: {diff}");
    }
    assert!(!ort.exists(), "the broken ORT-format file is gone");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_processes_saving_one_prepacked_copy_both_succeed_and_leave_no_half_copy() {
    // A `snooze prepare` beside the server, or two replicas on one volume: both convert,
    // the first rename wins, the second found a directory in its way and failed (and left
    // its 200 MB temporary copy behind).
    let dir = cache_dir("racing-prepare");
    let b = backend().with_cache_dir(dir.path());
    let both: Vec<_> = std::thread::scope(|s| {
        let racing: Vec<_> =
            (0..2).map(|_| s.spawn(|| b.prepare(&spec("mlp-100m-1", Weights::Prepacked)))).collect();
        racing.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for result in both {
        result.expect("the second saver takes the first one's copy");
    }
    assert_eq!(entries(dir.path(), ".prepacked").len(), 1);
    let half: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(half.is_empty(), "left behind: {half:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model whose weights are nearly all panels in its mapped copy runs as fast from it as
/// prepacked: promoting it gains nothing. Models with other weights, other tasks, and any
/// model where there is no cache for a mapped copy, gain.
#[test]
fn prepacking_gains_unless_the_weights_are_panels() {
    let cache = cache_dir("gains");
    let b = backend().with_cache_dir(cache.path());
    assert!(!b.prepacking_gains(&model("mlp-100m-1")), "an MLP: all panels but its biases");
    assert!(!b.prepacking_gains(&model("mlp-10m")));
    assert!(b.prepacking_gains(&model("ocr-det")), "convolutions");
    assert!(b.prepacking_gains(&model("minilm-onnx")), "an encoder (rank-3 activations)");
    assert!(backend().prepacking_gains(&model("mlp-100m-1")), "no cache: no mapped copy");
}
