mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::time::Duration;

use amp_broker::broker::embedded::{Durability, EmbeddedOptions, EmbeddedServer};

fn info_line(url: &str) -> String {
    let addr = url.trim_start_matches("nats://");
    let stream = TcpStream::connect(addr).expect("connect to the embedded server");
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .expect("INFO line");
    line
}

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

#[test]
fn embedded_server_runs_jetstream_is_restarted_after_a_crash_and_stops_on_request() {
    let dir = tempfile::tempdir().expect("data dir");
    let mut server = EmbeddedServer::start(EmbeddedOptions {
        binary: common::nats_server_bin(),
        data_dir: dir.path().to_path_buf(),
        durability: Durability::Always,
        ready_timeout: Duration::from_secs(20),
    })
    .expect("embedded nats-server starts");
    assert!(info_line(&server.url()).contains("\"jetstream\":true"));
    let conf =
        std::fs::read_to_string(dir.path().join("nats-server.conf")).expect("config written");
    assert!(conf.contains("sync_interval: always"), "{conf}");

    let first = server.pid().expect("running");
    std::process::Command::new("kill")
        .args(["-KILL", &first.to_string()])
        .status()
        .expect("kill");
    assert!(common::wait_until(Duration::from_secs(10), || server
        .supervise()
        .expect("supervise")
        .is_some()));
    assert_eq!(server.restarts(), 1);
    let second = server.pid().expect("restarted");
    assert_ne!(first, second);
    assert!(info_line(&server.url()).contains("\"jetstream\":true"));
    assert!(
        dir.path().join("nats").join("jetstream").is_dir(),
        "store under the data directory"
    );

    server.stop(Duration::from_secs(10));
    assert!(server.pid().is_none());
    assert!(!pid_alive(second), "child stopped");
}

#[test]
fn embedded_server_reports_a_binary_that_cannot_start() {
    let dir = tempfile::tempdir().expect("data dir");
    let err = EmbeddedServer::start(EmbeddedOptions {
        binary: dir.path().join("no-such-nats-server"),
        data_dir: dir.path().to_path_buf(),
        durability: Durability::Always,
        ready_timeout: Duration::from_secs(5),
    })
    .err()
    .expect("start fails");
    assert!(err.to_string().contains("no-such-nats-server"), "{err}");
}
