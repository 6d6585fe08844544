//! Phases 1.-4. of the swap benchmark for one profile, in a child process of its own
//! (ONNX Runtime allows one environment per process, and a fresh process keeps the RSS
//! deltas clean): resident memory of three models, load time, time to first response
//! after an eviction, and run time; reported to the parent as one JSON line.

use std::{
    path::Path,
    process::{Command, Stdio},
    sync::Arc,
    time::Instant,
};

use anyhow::{anyhow, bail, ensure, Context};
use snooze_backend_ort::OrtBackend;
use snooze_core::{Backend, LoadedModel, TensorData, Weights};

use crate::{
    common::{models_dir, ort_dylib},
    max_abs_diff, numpy_row, onnx_file, ort_copy,
    report::ms,
    rss_parts_mib, spec, warm_page_cache, ChildReport, Input, Profile, CHILD_ARG, LOADS, MODEL,
    NUMPY_TOLERANCE, RESIDENT, RUNS, RUN_WARM_UP, WARM_UP_MODEL,
};

/// How a child loads: the `ort` crate directly, or the backend with a profile.
enum Loader {
    Raw(ort::environment::Environment),
    Backend(OrtBackend, Weights),
}

enum Loaded {
    Raw(ort::session::Session),
    Backend(Arc<dyn LoadedModel>),
}

impl Loader {
    fn load(&self, models: &Path, name: &str) -> anyhow::Result<Loaded> {
        Ok(match self {
            Loader::Raw(env) => Loaded::Raw(
                ort::session::Session::builder(env)
                    .map_err(|e| anyhow!("{e}"))?
                    .commit_from_file(onnx_file(models, name)?)
                    .map_err(|e| anyhow!("{name}: {e}"))?,
            ),
            Loader::Backend(b, w) => {
                Loaded::Backend(b.load(&spec(models, name, *w)).map_err(|e| anyhow!("{e}"))?)
            }
        })
    }
}

impl Loaded {
    fn run(&mut self, x: &Input) -> anyhow::Result<Vec<f32>> {
        match self {
            Loaded::Raw(session) => {
                let view = ort::value::TensorRef::from_array_view((x.shape.clone(), x.data.as_slice()))
                    .map_err(|e| anyhow!("{e}"))?;
                let out = session.run(ort::inputs!["x" => view]).map_err(|e| anyhow!("{e}"))?;
                let y = out.get("y").context("no output y")?;
                let (_, data) = y.try_extract_tensor::<f32>().map_err(|e| anyhow!("{e}"))?;
                Ok(data.to_vec())
            }
            Loaded::Backend(m) => {
                let out = m.infer(&[x.tensor()], &[]).map_err(|e| anyhow!("{e}"))?;
                match out.into_iter().next().map(|t| t.data) {
                    Some(TensorData::Fp32(v)) => Ok(v),
                    other => bail!("unexpected output {other:?}"),
                }
            }
        }
    }
}

pub(crate) fn child_main(args: &[String]) -> anyhow::Result<()> {
    let [profile, cache] = args else { bail!("usage: {CHILD_ARG} <profile> <cache dir>") };
    let profile = Profile::parse(profile).with_context(|| format!("unknown profile {profile}"))?;
    let loader = match profile {
        Profile::Raw => {
            // Default options: ONNX Runtime as an application would use it.
            let env = ort::init_from(ort_dylib())
                .map_err(|e| anyhow!("{e}"))?
                .build()
                .map_err(|e| anyhow!("{e}"))?;
            Loader::Raw(env)
        }
        Profile::PrepackedOnnx => {
            Loader::Backend(OrtBackend::new(None).map_err(anyhow::Error::msg)?, Weights::Prepacked)
        }
        p => Loader::Backend(
            OrtBackend::new(None).map_err(anyhow::Error::msg)?.with_cache_dir(cache),
            p.weights(),
        ),
    };
    let report = measure(&loader, &models_dir(), Path::new(cache))?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

fn measure(loader: &Loader, models: &Path, cache: &Path) -> anyhow::Result<ChildReport> {
    let one = Input::rows(1);
    let eight = Input::rows(8);
    let trim = snooze_core::memory::trim_heap;
    let mut files = Vec::new();
    for name in RESIDENT.iter().chain([&WARM_UP_MODEL]) {
        files.push(onnx_file(models, name)?);
        files.extend(ort_copy(cache, name).ok());
    }
    warm_page_cache(&files)?;

    let mut warm = loader.load(models, WARM_UP_MODEL)?;
    warm.run(&eight)?;
    drop(warm);
    trim();

    // 1. Three models resident, each run once at batch 8.
    let (rss0, anon0, file0) = rss_parts_mib()?;
    let mut resident = Vec::new();
    let mut out8 = Vec::new();
    for name in RESIDENT {
        let mut m = loader.load(models, name)?;
        let out = m.run(&eight)?;
        if name == MODEL {
            out8 = out;
        }
        resident.push(m);
    }
    let (rss1, anon1, file1) = rss_parts_mib()?;
    drop(resident);
    trim();
    let per_model = |a: f64, b: f64| (b - a) / RESIDENT.len() as f64;

    // 2. Load time.
    warm_page_cache(&files)?;
    let mut load_ms = Vec::new();
    for _ in 0..LOADS {
        let t = Instant::now();
        let m = loader.load(models, MODEL)?;
        load_ms.push(ms(t.elapsed()));
        drop(m);
        trim();
    }

    // 3. Time to first response after an eviction: load + one batch-1 run.
    let want = numpy_row(MODEL);
    let mut ttfr_ms = Vec::new();
    for _ in 0..LOADS {
        let t = Instant::now();
        let mut m = loader.load(models, MODEL)?;
        let out = m.run(&one)?;
        ttfr_ms.push(ms(t.elapsed()));
        let diff = max_abs_diff(&out, &want);
        ensure!(diff <= NUMPY_TOLERANCE, "batch-1 output differs from numpy by {diff}");
        drop(m);
        trim();
    }

    // 4. Run time, batch 1 then batch 8.
    let mut m = loader.load(models, MODEL)?;
    let mut timed = |x: &Input| -> anyhow::Result<Vec<f64>> {
        for _ in 0..RUN_WARM_UP {
            m.run(x)?;
        }
        (0..RUNS)
            .map(|_| {
                let t = Instant::now();
                m.run(x)?;
                Ok(ms(t.elapsed()))
            })
            .collect()
    };
    let run1_ms = timed(&one)?;
    let run8_ms = timed(&eight)?;
    drop(m);

    Ok(ChildReport {
        rss_mib: per_model(rss0, rss1),
        anon_mib: per_model(anon0, anon1),
        file_mib: per_model(file0, file1),
        load_ms,
        ttfr_ms,
        run1_ms,
        run8_ms,
        out8,
    })
}

pub(crate) fn run_child(profile: Profile, cache: &Path) -> anyhow::Result<ChildReport> {
    let exe = std::env::current_exe().context("this benchmark's executable")?;
    let out = Command::new(exe)
        .arg(CHILD_ARG)
        .arg(profile.arg())
        .arg(cache)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("start the {} child", profile.arg()))?;
    ensure!(out.status.success(), "the {} child failed: {}", profile.arg(), out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.starts_with('{')).context("no report from the child")?;
    serde_json::from_str(line).with_context(|| format!("the {} child's report", profile.arg()))
}
