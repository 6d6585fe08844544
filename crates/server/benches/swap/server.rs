//! Phase 7. of the swap benchmark: the real `snooze` binary with two 100 MiB models and
//! `max_loaded_models = 1`, so every request alternating between them is an eviction, a
//! load and a first run, timed from send to response.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context};
use serde_json::{json, Value};

use crate::{
    common::{self, client, Server},
    max_abs_diff, numpy_row, onnx_file, warm_page_cache, Input, NUMPY_TOLERANCE,
};

pub(crate) struct Served {
    pub(crate) weights: &'static str,
    pub(crate) latencies: Vec<Duration>,
    pub(crate) loads: u64,
    pub(crate) evictions: u64,
    pub(crate) exit_ok: bool,
}

fn server_config(models: &Path, weights: &str) -> String {
    let mut c =
        String::from("[server]\nkeep_alive = \"-1\"\nmin_residency = \"0s\"\nmax_loaded_models = 1\n");
    for (name, dir) in [("m1", "mlp-100m-1"), ("m2", "mlp-100m-2")] {
        c +=
            &format!("[models.{name}]\npath = \"{}\"\nweights = \"{weights}\"\n", models.join(dir).display());
    }
    c
}

fn loads_and_evictions(cl: &reqwest::blocking::Client, server: &Server) -> anyhow::Result<(u64, u64)> {
    let admin: Value = cl.get(server.url("/admin/models")).send()?.error_for_status()?.json()?;
    let models = admin["models"].as_array().context("no models array in /admin/models")?;
    let sum = |key: &str| models.iter().map(|m| m[key].as_u64().unwrap_or(0)).sum::<u64>();
    Ok((sum("loads"), sum("evictions")))
}

pub(crate) fn server_swaps(models: &Path, weights: &'static str, n: usize) -> anyhow::Result<Served> {
    let case = |name: &'static str, file: &str| -> anyhow::Result<(&'static str, Vec<u8>, Vec<f32>)> {
        let one = Input::rows_of(file, 1);
        let body = serde_json::to_vec(
            &json!({"inputs": [{"name": "x", "shape": one.shape, "datatype": "FP32", "data": one.data}]}),
        )?;
        Ok((name, body, numpy_row(file)))
    };
    let cases = [case("m1", "mlp-100m-1")?, case("m2", "mlp-100m-2")?];
    warm_page_cache(&[onnx_file(models, "mlp-100m-1")?, onnx_file(models, "mlp-100m-2")?])?;
    let server = Server::start(&format!("swap-{weights}"), &server_config(models, weights), &[]);
    let cl = client();
    let request = |k: usize| -> anyhow::Result<Duration> {
        let (name, body, want) = &cases[k % 2];
        // The connection is open before the clock starts.
        ensure!(cl.get(server.url("/v2/health/ready")).send()?.status() == 200, "server not ready");
        let t = Instant::now();
        let resp = cl
            .post(server.url(&format!("/v2/models/{name}/infer")))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()?;
        let status = resp.status();
        let bytes = resp.bytes()?;
        let took = t.elapsed();
        ensure!(status == 200, "{name}: {status} {}", String::from_utf8_lossy(&bytes));
        let v: Value = serde_json::from_slice(&bytes)?;
        let diff = max_abs_diff(&common::floats(&v["outputs"][0]["data"]), want);
        ensure!(diff <= NUMPY_TOLERANCE, "{name} ({weights}): output differs from numpy by {diff}");
        Ok(took)
    };
    // Both loaded once (converted, for mapped) and swapped once more, untimed.
    for k in 0..4 {
        request(k)?;
    }
    let (loads0, evictions0) = loads_and_evictions(&cl, &server)?;
    let latencies = (0..n).map(request).collect::<anyhow::Result<Vec<_>>>()?;
    let (loads1, evictions1) = loads_and_evictions(&cl, &server)?;
    let status = server.terminate();
    Ok(Served {
        weights,
        latencies,
        loads: loads1.saturating_sub(loads0),
        evictions: evictions1.saturating_sub(evictions0),
        exit_ok: status.success(),
    })
}
