//! `snooze`: serve models, or check a config / estimate a model without serving.

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand, ValueEnum};
use snooze_core::units::format_bytes;
use snooze_server::config::{self, RawServer, Scalar, DEFAULT_CONFIG};

/// SnoozeML: serve many ML models from a machine that cannot hold them all at once.
///
/// Models load on their first request, stay while used, unload when idle, and the
/// least-recently-used idle model is evicted when memory is needed; a request that
/// cannot get memory gets 503 with Retry-After instead of the process dying.
#[derive(Parser)]
#[command(name = "snooze", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start the server (KServe v2 REST, OpenAI /v1/embeddings, admin API).
    Serve(Box<ServeArgs>),
    /// Validate a config file without serving; exits non-zero with the reason.
    Check {
        /// The snooze.toml to check.
        config: PathBuf,
        /// Also resolve this model repository, like `serve --model-dir`.
        #[arg(long)]
        model_dir: Option<PathBuf>,
    },
    /// Work with `/admin/memory/dump` snapshots.
    Dump {
        #[command(subcommand)]
        command: DumpCommand,
    },
    /// Print a model's footprint estimate and how it was derived.
    Estimate {
        /// A model file or folder.
        path: PathBuf,
        /// The backend; guessed from the files when omitted.
        #[arg(long, value_parser = ["onnx", "candle"])]
        backend: Option<String>,
    },
}

#[derive(Subcommand)]
enum DumpCommand {
    /// Show what grew between two dumps (saved from GET /admin/memory/dump).
    Diff { before: PathBuf, after: PathBuf },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Every `[server]` key can also be set by a flag or a `SNOOZE_<KEY>` variable
/// (flag > env > file > default).
#[derive(clap::Args)]
struct ServeArgs {
    /// Config file (TOML). Without it, the embedded default config serves the demo models.
    #[arg(long, env = "SNOOZE_CONFIG")]
    config: Option<PathBuf>,
    /// Serve every sub-folder of DIR holding model.onnx or 1/model.onnx, named after the folder.
    #[arg(long, env = "SNOOZE_MODEL_DIR")]
    model_dir: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:8080]; port 0 picks a free port.
    #[arg(long, env = "SNOOZE_HTTP_ADDRESS")]
    http_address: Option<String>,
    /// Memory budget for the whole process: "auto" (machine or cgroup limit minus headroom), "80%", "6GiB" [default: auto].
    #[arg(long, env = "SNOOZE_HOST_MEMORY_LIMIT")]
    host_memory_limit: Option<String>,
    /// Memory kept free on top of each model's footprint [default: 64MiB].
    #[arg(long, env = "SNOOZE_HEADROOM")]
    headroom: Option<String>,
    /// How long an idle model stays loaded after its last request; 0 = unload at once, -1 = never [default: 5m].
    #[arg(long, env = "SNOOZE_KEEP_ALIVE", allow_hyphen_values = true)]
    keep_alive: Option<String>,
    /// A model is not evicted sooner than this after loading (stops ping-pong) [default: 10s].
    #[arg(long, env = "SNOOZE_MIN_RESIDENCY")]
    min_residency: Option<String>,
    /// Most models loaded at once; 0 = no cap [default: 0].
    #[arg(long, env = "SNOOZE_MAX_LOADED_MODELS")]
    max_loaded_models: Option<String>,
    /// Retry-After sent with refusals that have no better estimate [default: 5s].
    #[arg(long, env = "SNOOZE_RETRY_AFTER")]
    retry_after: Option<String>,
    /// Where the server keeps its state (learned footprints) [default: .snooze].
    #[arg(long, env = "SNOOZE_STATE_DIR")]
    state_dir: Option<String>,
    /// How long SIGTERM/SIGINT waits for requests in flight before unloading and exiting [default: 30s].
    #[arg(long, env = "SNOOZE_SHUTDOWN_TIMEOUT")]
    shutdown_timeout: Option<String>,
    /// Longest a request waits for its model to load before a 503 [default: 120s].
    #[arg(long, env = "SNOOZE_ACQUIRE_TIMEOUT")]
    acquire_timeout: Option<String>,
    /// Largest request body; larger ones get 413 [default: 64MiB].
    #[arg(long, env = "SNOOZE_MAX_REQUEST_SIZE")]
    max_request_size: Option<String>,
    /// Threads one inference may use inside ONNX Runtime; 0 = runtime default [default: 0].
    #[arg(long, env = "SNOOZE_INTRA_OP_THREADS")]
    intra_op_threads: Option<String>,
    /// Most inputs in one /v1/embeddings request [default: 256].
    #[arg(long, env = "SNOOZE_MAX_EMBEDDING_INPUTS")]
    max_embedding_inputs: Option<String>,
    /// Longest text (in characters) one embedding input may have [default: 100000].
    #[arg(long, env = "SNOOZE_MAX_INPUT_CHARS")]
    max_input_chars: Option<String>,
    /// Share of the budget (RSS / budget) that raises a warning alert [default: 0.80].
    #[arg(long, env = "SNOOZE_MEMORY_WARNING_THRESHOLD")]
    memory_warning_threshold: Option<String>,
    /// Share of the budget at which loads must evict first and low-priority requests get 503 [default: 0.95].
    #[arg(long, env = "SNOOZE_MEMORY_CRITICAL_THRESHOLD")]
    memory_critical_threshold: Option<String>,
    /// Share of the budget at which every idle, unpinned model is unloaded [default: 0.98].
    #[arg(long, env = "SNOOZE_MEMORY_EMERGENCY_THRESHOLD")]
    memory_emergency_threshold: Option<String>,
    /// How often the memory monitor reads the probe (also after every load) [default: 5s].
    #[arg(long, env = "SNOOZE_MEMORY_CHECK_INTERVAL")]
    memory_check_interval: Option<String>,
    /// Tune glibc for small RAM (one arena, 64 KiB mmap threshold) and trim after large requests [default: false].
    #[arg(long, env = "SNOOZE_LOW_RAM_MODE")]
    low_ram_mode: Option<String>,
    /// Bearer token required by admin writes (gc, repository load/unload); unset = open.
    #[arg(long, env = "SNOOZE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Log format.
    #[arg(long, env = "SNOOZE_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
}

impl ServeArgs {
    fn overrides(&self) -> RawServer {
        let s = |v: &Option<String>| v.clone().map(Scalar::Str);
        RawServer {
            http_address: s(&self.http_address),
            host_memory_limit: s(&self.host_memory_limit),
            headroom: s(&self.headroom),
            keep_alive: s(&self.keep_alive),
            min_residency: s(&self.min_residency),
            max_loaded_models: s(&self.max_loaded_models),
            retry_after: s(&self.retry_after),
            state_dir: s(&self.state_dir),
            model_dir: None,
            shutdown_timeout: s(&self.shutdown_timeout),
            acquire_timeout: s(&self.acquire_timeout),
            max_request_size: s(&self.max_request_size),
            intra_op_threads: s(&self.intra_op_threads),
            max_embedding_inputs: s(&self.max_embedding_inputs),
            max_input_chars: s(&self.max_input_chars),
            memory_warning_threshold: s(&self.memory_warning_threshold),
            memory_critical_threshold: s(&self.memory_critical_threshold),
            memory_emergency_threshold: s(&self.memory_emergency_threshold),
            memory_check_interval: s(&self.memory_check_interval),
            low_ram_mode: s(&self.low_ram_mode),
            admin_token: s(&self.admin_token),
        }
    }
}

fn load_config(
    path: Option<&PathBuf>,
    overrides: RawServer,
    model_dir: Option<PathBuf>,
) -> anyhow::Result<config::Config> {
    let cwd = std::env::current_dir()?;
    let (text, origin, base) = match path {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| anyhow::anyhow!("cannot read config {}: {e}", p.display()))?;
            let base = p.parent().map(|d| cwd.join(d)).unwrap_or_else(|| cwd.clone());
            (text, p.display().to_string(), base)
        }
        None => (DEFAULT_CONFIG.to_string(), "(embedded default)".to_string(), cwd.clone()),
    };
    let file = config::parse_file(&text, &origin)?;
    // A --model-dir flag is relative to where the command runs, not to the file.
    Ok(config::resolve(file, overrides, model_dir.map(|d| cwd.join(d)), &base)?)
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SNOOZE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,ort=warn"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
    else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let config = load_config(args.config.as_ref(), args.overrides(), args.model_dir.clone())?;
    let state = snooze_server::build(&config)?;
    let listener = tokio::net::TcpListener::bind(&config.server.http_address)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", config.server.http_address))?;
    let addr = listener.local_addr()?;
    tracing::info!(address = %addr, models = config.models.len(), "listening on http://{addr}");
    snooze_server::serve(listener, state, shutdown_signal()).await
}

fn guess_backend(path: &std::path::Path) -> &'static str {
    if path.join("config.json").is_file() && !path.join("model.onnx").exists() {
        "candle"
    } else {
        "onnx"
    }
}

fn estimate(path: PathBuf, backend: Option<String>) -> anyhow::Result<()> {
    let kind = backend.as_deref().unwrap_or_else(|| guess_backend(&path));
    let backend: Box<dyn snooze_core::Backend> = match kind {
        "candle" => Box::new(snooze_backend_candle::CandleBackend::new()),
        _ => Box::new(snooze_backend_ort::OrtBackend::new(None).map_err(anyhow::Error::msg)?),
    };
    let e = backend.estimate(&path);
    let show = |b: Option<u64>| {
        b.map_or("indeterminate".to_string(), |b| format!("{} ({b} bytes)", format_bytes(b)))
    };
    println!("model:    {}", path.display());
    println!("backend:  {}", backend.name());
    println!("steady:   {}", show(e.steady_bytes));
    println!("peak:     {}", show(e.peak_bytes));
    println!("how:      {}", e.derivation);
    Ok(())
}

fn dump_diff(before: PathBuf, after: PathBuf) -> anyhow::Result<()> {
    let read = |p: &PathBuf| -> anyhow::Result<serde_json::Value> {
        let text =
            std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))?;
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{} is not a JSON dump: {e}", p.display()))
    };
    let rows = snooze_server::dump::diff(&read(&before)?, &read(&after)?);
    print!("{}", snooze_server::dump::render(&rows));
    Ok(())
}

fn check(path: PathBuf, model_dir: Option<PathBuf>) -> anyhow::Result<()> {
    let config = load_config(Some(&path), RawServer::default(), model_dir)?;
    println!("{}: ok", path.display());
    println!("listen:   {}", config.server.http_address);
    println!(
        "budget:   {:?}, headroom {}",
        config.server.host_memory_limit,
        format_bytes(config.server.headroom)
    );
    for m in &config.models {
        println!("model:    {} ({}, {})", m.name, m.backend.name(), m.path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => {
            init_logs(args.log_format);
            match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
                Ok(rt) => rt.block_on(serve(*args)),
                Err(e) => Err(e.into()),
            }
        }
        Command::Check { config, model_dir } => check(config, model_dir),
        Command::Estimate { path, backend } => estimate(path, backend),
        Command::Dump { command: DumpCommand::Diff { before, after } } => dump_diff(before, after),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("snooze: {e:#}");
            ExitCode::FAILURE
        }
    }
}
