//! `snooze`: serve models, or check a config / estimate a model without serving.

use std::{path::PathBuf, process::ExitCode};

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use snooze_core::units::{format_bytes, MemorySize};
use snooze_server::{
    client,
    config::{self, MemoryLimit, RawServer, DEFAULT_CONFIG},
};

/// SnoozeML: serve many ML models from a machine that cannot hold them all at once.
///
/// Models load on their first request, stay while used, unload when idle, and the idle
/// model worth least (rarely asked for, cheap to bring back, large) is evicted when
/// memory is needed; a request that
/// cannot get memory gets 503 with Retry-After instead of the process dying.
#[derive(Parser)]
#[command(name = "snooze", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where a running server is, for the client commands.
#[derive(clap::Args)]
struct Remote {
    /// The server's address.
    #[arg(long, env = "SNOOZE_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The server's admin token, when it has one.
    #[arg(long, env = "SNOOZE_ADMIN_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Start the server (KServe v2 REST and gRPC; OpenAI /v1/embeddings and /v1/audio;
    /// /v1/ocr; the admin API).
    Serve(Box<ServeArgs>),
    /// Make the one-time copies the models load fastest from (ORT format, prepacked)
    /// into state_dir now, instead of in the background of a running server: for an
    /// image build, an init container or before a deploy. Takes `serve`'s flags.
    Prepare(Box<ServeArgs>),
    /// One model's one-time preparation, as the server runs it in a child process.
    #[command(hide = true)]
    PrepareModel {
        #[arg(long)]
        backend: String,
        #[arg(long)]
        path: PathBuf,
        #[arg(long)]
        weights: String,
        #[arg(long)]
        state_dir: PathBuf,
        #[arg(long, default_value_t = 0)]
        intra_op_threads: usize,
    },
    /// Validate a config file without serving; exits non-zero with the reason.
    /// Takes `serve`'s flags and `SNOOZE_*` variables, and checks what `serve` would use.
    Check {
        /// The snooze.toml to check.
        #[arg(env = "SNOOZE_CONFIG")]
        config: PathBuf,
        /// Also resolve this model repository, like `serve --model-dir`.
        #[arg(long, env = "SNOOZE_MODEL_DIR", value_name = "DIR")]
        model_dir: Option<PathBuf>,
    },
    /// List the models of a running server: state, device, memory, leases, queue, unload time.
    Ps {
        #[command(flatten)]
        remote: Remote,
        /// Print the admin API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Load a model on a running server (waits until it is ready).
    Load {
        /// The model's name (as `ps` lists it).
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Unload a model on a running server (waits for its requests to finish).
    Unload {
        /// The model's name (as `ps` lists it).
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Unload every idle model of a running server and give memory back to the OS.
    Gc {
        #[command(flatten)]
        remote: Remote,
    },
    /// Memory of a running server: budget, process, accounted, available, alerts.
    Stats {
        #[command(flatten)]
        remote: Remote,
        /// Print the admin API's JSON instead of a summary.
        #[arg(long)]
        json: bool,
    },
    /// `stats` and `ps`, refreshed every second until Ctrl-C.
    Top {
        #[command(flatten)]
        remote: Remote,
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
        /// How the weights would be held (ONNX models).
        #[arg(long, value_parser = ["prepacked", "compact", "mapped"], default_value = "prepacked")]
        weights: String,
        /// The server's state dir: a form whose one-time copy is there (`snooze prepare`)
        /// is estimated as loaded from it; without it, as a load before the copy exists.
        #[arg(long, env = "SNOOZE_STATE_DIR")]
        state_dir: Option<PathBuf>,
    },
}

impl Remote {
    fn client(self) -> anyhow::Result<client::Client> {
        client::Client::new(&self.url, self.token)
    }
}

#[derive(Subcommand)]
enum DumpCommand {
    /// Show what grew between two dumps (saved from GET /admin/memory/dump).
    Diff {
        /// The earlier dump (a JSON file).
        before: PathBuf,
        /// The later dump.
        after: PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// `serve`'s own flags; every `[server]` key is added as `--<key>` / `SNOOZE_<KEY>`
/// from [`config::SERVER_KEYS`] (flag > env > file > default).
#[derive(clap::Args)]
struct ServeArgs {
    /// Config file (TOML). Without it, the embedded default config serves the demo models.
    #[arg(long, env = "SNOOZE_CONFIG")]
    config: Option<PathBuf>,
    /// Serve every sub-folder of DIR holding model.onnx or 1/model.onnx, or a
    /// sentence-transformers model, named after the folder (relative to the working
    /// directory; `model_dir` in the file is relative to the file).
    #[arg(long, env = "SNOOZE_MODEL_DIR", value_name = "DIR")]
    model_dir: Option<PathBuf>,
    /// Log format.
    #[arg(long, env = "SNOOZE_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
}

/// Whoever reads `--help` gets one flag per `[server]` key, with its env var and default.
fn server_key_args() -> Vec<clap::Arg> {
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    config::SERVER_KEYS
        .iter()
        .filter(|k| k.name != "model_dir") // a typed flag above: relative to the working directory
        .map(|k| {
            let default =
                if k.default.is_empty() { String::new() } else { format!(" [default: {}]", k.default) };
            clap::Arg::new(k.name)
                .long(leak(k.flag()[2..].to_string()))
                .env(leak(k.env()))
                .hide_env_values(k.secret())
                .allow_hyphen_values(true)
                .value_name("VALUE")
                .help(format!("{}{default}", k.help()))
        })
        .collect()
}

/// The `[server]` keys set by flag or environment, with where each came from. A path
/// given so is relative to the working directory (the file's are relative to the file).
fn overrides(matches: &clap::ArgMatches) -> RawServer {
    let mut raw = RawServer::default();
    let cwd = std::env::current_dir().unwrap_or_default();
    for k in config::SERVER_KEYS {
        if let Ok(Some(v)) = matches.try_get_one::<String>(k.name) {
            let v = match k.name {
                "state_dir" | "api_keys_file" if !v.is_empty() => cwd.join(v).display().to_string(),
                _ => v.clone(),
            };
            let origin = match matches.value_source(k.name) {
                Some(clap::parser::ValueSource::EnvVariable) => config::Origin::Env,
                _ => config::Origin::Flag,
            };
            raw.set_from(k.name, v, origin);
        }
    }
    raw
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
    let config = config::resolve(file, overrides, model_dir.map(|d| cwd.join(d)), &base);
    match (config, path) {
        (Ok(c), _) => Ok(c),
        (Err(e), Some(_)) => Err(e.into()),
        (Err(e), None) => Err(anyhow::anyhow!(
            "{e} (the embedded default config serves the demo models under models/ of the working \
             directory, {}: run it from the repository root after `make prepare`, or give --config)",
            cwd.display()
        )),
    }
}

fn init_logs(format: LogFormat) {
    // The audio decoders log what they find wrong in a file (hundreds of lines, some at
    // ERROR, for one upload that is not audio); the client's mistake is its 400, not the
    // server's log.
    const DEFAULT: &str = "info,ort=warn,symphonia=off";
    let (filter, refused) = match std::env::var("SNOOZE_LOG") {
        Err(_) => (tracing_subscriber::EnvFilter::new(DEFAULT), None),
        Ok(asked) => match tracing_subscriber::EnvFilter::try_new(&asked) {
            Ok(filter) => (filter, None),
            Err(e) => (tracing_subscriber::EnvFilter::new(DEFAULT), Some((asked, e))),
        },
    };
    // Colours only for a terminal: a file or a container's log gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    // A typo in the filter would otherwise go unnoticed (the defaults log on).
    if let Some((asked, e)) = refused {
        tracing::warn!(SNOOZE_LOG = %asked, error = %e, "SNOOZE_LOG is not a log filter: logging at the default levels ({DEFAULT})");
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

async fn serve(args: ServeArgs, overrides: RawServer) -> anyhow::Result<()> {
    let config = load_config(args.config.as_ref(), overrides, args.model_dir.clone())?;
    if config.models.is_empty() {
        tracing::warn!("{}", config::NO_MODELS);
    }
    let state = snooze_server::build(&config)?;
    let listener = tokio::net::TcpListener::bind(&config.server.http_address)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", config.server.http_address))?;
    let grpc = match config.server.grpc_address.as_str() {
        "off" => None,
        address => {
            let l = tokio::net::TcpListener::bind(address).await.map_err(|e| {
                anyhow::anyhow!("cannot listen on {address} (grpc_address): {e}; set grpc_address = \"off\" to serve without gRPC")
            })?;
            let addr = l.local_addr()?;
            tracing::info!(address = %addr, "gRPC on grpc://{addr}");
            Some(l)
        }
    };
    // Last: whoever waits for this line finds both services up.
    let addr = listener.local_addr()?;
    tracing::info!(address = %addr, models = config.models.len(), "listening on http://{addr}");
    snooze_server::serve(listener, grpc, state, shutdown_signal()).await
}

fn prepare(args: ServeArgs, overrides: RawServer) -> anyhow::Result<()> {
    let config = load_config(args.config.as_ref(), overrides, args.model_dir.clone())?;
    println!("state_dir: {}", config.server.state_dir.display());
    let done = snooze_server::prepare(&config, |line| println!("{line}"))?;
    if !done.unreadable.is_empty() {
        anyhow::bail!(
            "{} model(s) cannot be read ({}): a server would fail their every request",
            done.unreadable.len(),
            done.unreadable.join(", ")
        );
    }
    match done.failed {
        0 => Ok(()),
        n => anyhow::bail!("{n} preparation(s) failed; the models still load, from their .onnx"),
    }
}

fn prepare_model(
    backend: &str,
    path: PathBuf,
    weights: &str,
    state_dir: &std::path::Path,
    intra_op_threads: usize,
) -> anyhow::Result<()> {
    let weights =
        snooze_core::Weights::parse(weights).ok_or_else(|| anyhow::anyhow!("unknown weights {weights:?}"))?;
    let backend: Box<dyn snooze_core::Backend> = match backend {
        "onnx" => {
            let pool = snooze_backend_ort::ThreadPool { intra_op_threads, spinning: false };
            Box::new(
                snooze_backend_ort::OrtBackend::with_pool(None, pool)
                    .map_err(anyhow::Error::msg)?
                    .with_cache_dir(state_dir.join("ort-cache")),
            )
        }
        "candle" => Box::new(snooze_backend_candle::CandleBackend::new()),
        other => anyhow::bail!("unknown backend {other:?}"),
    };
    let spec = snooze_core::LoadSpec {
        name: path.display().to_string(),
        path,
        device: snooze_core::Device::Cpu,
        intra_op_threads,
        instances: 1,
        weights,
        low_cpu_priority: false,
    };
    backend.prepare(&spec).map_err(|e| anyhow::anyhow!("{e}"))
}

fn estimate(
    path: PathBuf,
    backend: Option<String>,
    weights: &str,
    state_dir: Option<PathBuf>,
) -> anyhow::Result<()> {
    if !path.exists() {
        anyhow::bail!("{} does not exist", path.display());
    }
    // The server's rule when a config names no backend.
    let kind = backend.as_deref().unwrap_or_else(|| config::backend_for(&path).name());
    let backend: Box<dyn snooze_core::Backend> = match kind {
        "candle" => Box::new(snooze_backend_candle::CandleBackend::new()),
        _ => {
            let ort = snooze_backend_ort::OrtBackend::new(None).map_err(anyhow::Error::msg)?;
            Box::new(match state_dir {
                Some(dir) => ort.with_cache_dir(dir.join("ort-cache")),
                None => ort,
            })
        }
    };
    let weights = snooze_core::Weights::parse(weights).unwrap_or_default();
    let e = backend.estimate(&path, weights);
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

fn check(path: PathBuf, model_dir: Option<PathBuf>, overrides: RawServer) -> anyhow::Result<()> {
    let config = load_config(Some(&path), overrides, model_dir)?;
    println!("{}: ok", path.display());
    println!("listen:   {} (gRPC: {})", config.server.http_address, config.server.grpc_address);
    let budget = match config.server.host_memory_limit {
        MemoryLimit::Auto => "auto (the machine's or its cgroup's memory)".to_string(),
        MemoryLimit::Size(MemorySize::Bytes(b)) => format_bytes(b),
        MemoryLimit::Size(MemorySize::Percent(p)) => format!("{p}% of the machine's memory"),
    };
    println!("budget:   {budget}, headroom {}", format_bytes(config.server.headroom));
    for m in &config.models {
        println!("model:    {} ({}, {})", m.name, m.backend.name(), m.path.display());
    }
    for p in &config.pipelines {
        let cls = p.cls.as_deref().map(|c| format!(", cls {c}")).unwrap_or_default();
        println!("pipeline: {} (det {}{cls}, rec {})", p.name, p.det, p.rec);
    }
    if config.models.is_empty() {
        println!("warning:  {}", config::NO_MODELS);
    }
    Ok(())
}

fn main() -> ExitCode {
    let matches = Cli::command()
        .mut_subcommand("serve", |c| c.args(server_key_args()))
        .mut_subcommand("prepare", |c| c.args(server_key_args()))
        .mut_subcommand("check", |c| c.args(server_key_args()))
        .get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if !matches!(cli.command, Command::Serve(_) | Command::Prepare(_) | Command::PrepareModel { .. }) {
        // A command that prints for a reader (`snooze ps | head`) ends quietly when the
        // reader stops, as other tools do, instead of panicking on a closed pipe (Rust
        // ignores SIGPIPE; a server must, for its sockets, and keeps doing so).
        // SAFETY: resetting a signal to its default before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    if matches!(cli.command, Command::Serve(_)) {
        // SIGHUP re-reads the API keys once the server runs; until its handler is set
        // (tens of milliseconds after start) the default action would end the process:
        // a key-rotation sidecar signalling during a restart killed it without a line.
        // SAFETY: setting a signal's disposition before any thread starts.
        unsafe { libc::signal(libc::SIGHUP, libc::SIG_IGN) };
    }
    let result = match cli.command {
        Command::Serve(args) => {
            init_logs(args.log_format);
            let overrides = matches.subcommand_matches("serve").map(overrides).unwrap_or_default();
            match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
                Ok(rt) => {
                    let served = rt.block_on(serve(*args, overrides));
                    // A run still going after shutdown_timeout (its request was cut off)
                    // must not hold the exit: dropping the runtime would wait for it.
                    rt.shutdown_timeout(std::time::Duration::from_millis(500));
                    served
                }
                Err(e) => Err(e.into()),
            }
        }
        Command::Prepare(args) => {
            init_logs(args.log_format);
            let overrides = matches.subcommand_matches("prepare").map(overrides).unwrap_or_default();
            prepare(*args, overrides)
        }
        Command::PrepareModel { backend, path, weights, state_dir, intra_op_threads } => {
            // Plain lines the server passes on to its own log (see prepare.rs).
            init_logs(LogFormat::Text);
            prepare_model(&backend, path, &weights, &state_dir, intra_op_threads)
        }
        Command::Check { config, model_dir } => {
            let overrides = matches.subcommand_matches("check").map(overrides).unwrap_or_default();
            check(config, model_dir, overrides)
        }
        Command::Estimate { path, backend, weights, state_dir } => {
            estimate(path, backend, &weights, state_dir)
        }
        Command::Dump { command: DumpCommand::Diff { before, after } } => dump_diff(before, after),
        Command::Ps { remote, json } => remote.client().and_then(|c| client::ps(&c, json)),
        Command::Load { name, remote } => remote.client().and_then(|c| client::load(&c, &name)),
        Command::Unload { name, remote } => remote.client().and_then(|c| client::unload(&c, &name)),
        Command::Gc { remote } => remote.client().and_then(|c| client::gc(&c)),
        Command::Stats { remote, json } => remote.client().and_then(|c| client::stats(&c, json)),
        Command::Top { remote } => remote.client().and_then(|c| client::top(&c)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("snooze: {e:#}");
            ExitCode::FAILURE
        }
    }
}
