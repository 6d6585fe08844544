//! Clients that hold connections without using them, on the real binary: half-sent
//! request heads, bodies trickling in a byte at a time, idle keep-alive connections,
//! more clients than `max_connections` — and memory that comes back after a thousand
//! oversize requests.

mod common;

use std::{
    io::{ErrorKind, Read, Write},
    net::TcpStream,
    time::{Duration, Instant},
};

use common::*;

fn config(extra: &str) -> String {
    format!(
        "[server]\nheader_read_timeout = \"1s\"\nbody_read_timeout = \"2s\"\nidle_timeout = \"2s\"\n{extra}\n\
         [models.mlp-10m]\npath = \"{}/mlp-10m\"\n",
        models_dir().display()
    )
}

fn connect(s: &Server) -> TcpStream {
    let c = TcpStream::connect(s.base.trim_start_matches("http://")).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    c
}

/// Reads until the server closes the connection; what it sent.
fn until_closed(c: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the server did not close the connection: {e}"),
        }
    }
    String::from_utf8_lossy(&out).to_string()
}

#[test]
fn half_sent_request_heads_are_closed_after_the_header_timeout() {
    let s = Server::start("slow-heads", &config(""), &[]);
    let started = Instant::now();
    let mut conns: Vec<TcpStream> = (0..32)
        .map(|_| {
            let mut c = connect(&s);
            c.write_all(b"POST /v2/models/mlp-10m/infer HTTP/1.1\r\nhost: x\r\ncontent-le").expect("write");
            c
        })
        .collect();
    for c in &mut conns {
        until_closed(c);
    }
    let took = started.elapsed();
    eprintln!("32 half-sent request heads closed after {:.2}s (header_read_timeout 1s)", took.as_secs_f64());
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn a_head_sent_one_byte_at_a_time_is_cut_off() {
    // A byte every 200 ms never leaves the connection quiet for header_read_timeout (1 s):
    // only a deadline on the whole head, not a timer each byte restarts, closes it, and
    // long before the 41-byte head is complete (8.2 s at this pace).
    let s = Server::start("slow-head-bytes", &config(""), &[]);
    let mut c = connect(&s);
    let head = b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n";
    let started = Instant::now();
    let reader = {
        let mut r = c.try_clone().expect("clone");
        std::thread::spawn(move || {
            let answer = until_closed(&mut r);
            (answer, started.elapsed())
        })
    };
    let mut sent = 0;
    for b in head {
        if reader.is_finished() || c.write_all(&[*b]).is_err() {
            break;
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    let (answer, closed_after) = reader.join().expect("reader");
    eprintln!(
        "a head at 5 bytes/s was cut off after {:.2}s and {sent} of {} bytes (header_read_timeout 1s)",
        closed_after.as_secs_f64(),
        head.len()
    );
    assert!(!answer.contains("200 OK"), "a head trickling in over {sent} bytes was served: {answer}");
    assert!(sent < head.len(), "the whole head went through before the server closed the connection");
    assert!(
        closed_after >= Duration::from_millis(900) && closed_after < Duration::from_secs(3),
        "closed after {closed_after:?}, not near header_read_timeout (1s)"
    );
}

#[test]
fn a_body_sent_one_byte_a_second_gets_408() {
    let s = Server::start("slow-body", &config(""), &[]);
    let mut c = connect(&s);
    c.write_all(b"POST /v2/models/mlp-10m/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n")
        .expect("head");
    let started = Instant::now();
    let writer = {
        let mut w = c.try_clone().expect("clone");
        std::thread::spawn(move || {
            for _ in 0..10 {
                if w.write_all(b" ").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };
    let answer = until_closed(&mut c);
    let took = started.elapsed();
    eprintln!("a body at 1 byte/s was cut off after {:.2}s (body_read_timeout 2s)", took.as_secs_f64());
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("body_read_timeout") && answer.contains("\"code\":\"request_timeout\""),
        "{answer}"
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
    let _ = writer.join();
}

#[test]
fn idle_keep_alive_connections_are_closed() {
    let s = Server::start("idle", &config(""), &[]);
    let mut c = connect(&s);
    c.write_all(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n").expect("write");
    let mut buf = [0u8; 1024];
    let n = c.read(&mut buf).expect("answer");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let started = Instant::now();
    until_closed(&mut c);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1800) && took < Duration::from_secs(6),
        "idle close after {took:?}"
    );
}

#[test]
fn clients_beyond_max_connections_wait_until_one_leaves() {
    let s = Server::start("max-conns", &config("max_connections = 2"), &["--idle-timeout", "60s"]);
    let request = b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n";
    let mut held: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut c = connect(&s);
            c.write_all(request).expect("write");
            let mut buf = [0u8; 1024];
            assert!(c.read(&mut buf).expect("answer") > 0);
            c
        })
        .collect();
    let mut third = connect(&s);
    third.write_all(request).expect("write");
    third.set_read_timeout(Some(Duration::from_millis(700))).expect("timeout");
    let mut buf = [0u8; 1024];
    assert!(third.read(&mut buf).is_err(), "a third client was served past max_connections = 2");
    held.pop();
    third.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let n = third.read(&mut buf).expect("served once a connection left");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
}

/// Sends `count` oversize requests: by Content-Length (refused before the body is
/// read) and, every tenth, chunked (read up to the limit, then refused).
fn oversize(s: &Server, count: usize, limit: usize) {
    let chunk = vec![b' '; 64 << 10];
    for i in 0..count {
        let mut c = connect(s);
        if i % 10 == 0 {
            let _ = c.write_all(
                b"POST /v2/models/mlp-10m/infer HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n",
            );
            let mut sent = 0;
            while sent <= limit {
                let head = format!("{:x}\r\n", chunk.len());
                if c.write_all(head.as_bytes())
                    .and_then(|()| c.write_all(&chunk))
                    .and_then(|()| c.write_all(b"\r\n"))
                    .is_err()
                {
                    break;
                }
                sent += chunk.len();
            }
        } else {
            let head = format!(
                "POST /v2/models/mlp-10m/infer HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
                limit + 1
            );
            let _ = c.write_all(head.as_bytes());
            let _ = c.write_all(&chunk);
        }
        let answer = until_closed(&mut c);
        assert!(answer.starts_with("HTTP/1.1 413"), "request {i}: {answer}");
    }
}

#[test]
fn rss_comes_back_after_a_thousand_oversize_requests() {
    let limit = 8 << 20;
    // As many workers as a large machine's: each reads into its own malloc arena, and
    // what a cut-off body left in an arena it had not used before stayed resident.
    let s = Server::start_env(
        "oversize",
        &config("max_request_size = \"8MiB\""),
        &[],
        &[("TOKIO_WORKER_THREADS", "32")],
    );
    oversize(&s, 20, limit); // warm up the connection and allocator paths
    std::thread::sleep(Duration::from_millis(1500));
    let before = s.rss();
    oversize(&s, 1000, limit);
    std::thread::sleep(Duration::from_millis(1500));
    let after = s.rss();
    eprintln!(
        "RSS before {:.1} MiB, after 1,000 oversize requests (100 of them read to the 8 MiB limit) {:.1} MiB",
        before as f64 / 1048576.0,
        after as f64 / 1048576.0
    );
    assert!(after <= before + before / 10, "RSS grew from {before} to {after}");
}
