//! The operator's command line, run as the built binary: help for each command,
//! `check-config`, and serve flags taken from the environment.

mod common;

use std::net::SocketAddr;
use std::os::unix::ffi::OsStrExt;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::amp::{http_get, open_config};
use common::{NatsServer, free_port};
use serde_json::json;

fn amp_broker() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_amp-broker"));
    // The tests set the environment they mean; nothing leaks in from the caller's.
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(|n| n.starts_with("AMP_")) {
            cmd.env_remove(name);
        }
    }
    cmd
}

fn run(args: &[&str]) -> Output {
    amp_broker().args(args).output().expect("run amp-broker")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn each_command_prints_its_own_help_and_exits_0() {
    for args in [
        &["serve", "--help"][..],
        &["serve", "-h"],
        &["help", "serve"],
    ] {
        let out = run(args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let text = stdout(&out);
        assert!(
            text.starts_with("usage: amp-broker serve"),
            "{args:?}: {text}"
        );
        for flag in [
            "--listen",
            "--nats-creds",
            "--callout-server-key",
            "AMP_NATS",
        ] {
            assert!(text.contains(flag), "{args:?} lacks {flag}: {text}");
        }
    }
    for args in [&["keygen", "--help"][..], &["keygen", "-h"]] {
        let out = run(args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert!(
            stdout(&out).starts_with("usage: amp-broker keygen"),
            "{}",
            stdout(&out)
        );
    }
    let out = run(&["check-config", "--help"]);
    assert!(out.status.success());
    assert!(stdout(&out).starts_with("usage: amp-broker check-config"));

    let out = run(&["--help"]);
    assert!(out.status.success());
    let overview = stdout(&out);
    for command in [
        "amp-broker serve",
        "amp-broker keygen",
        "amp-broker check-config",
    ] {
        assert!(overview.contains(command), "{overview}");
    }

    let out = run(&["serve", "--bogus"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("unknown flag `--bogus`"));
    // The mistake and where help is, not 70 lines of usage burying it.
    assert!(err.lines().count() <= 2, "{err}");
    assert!(err.contains("amp-broker serve --help"), "{err}");
}

/// Client input fills a namespace's inbox, topics and tasks streams; with the defaults
/// nothing bounds them, and the operator is told where to set a bound.
#[test]
fn check_config_warns_of_stores_nothing_bounds() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("config.json");
    let mut config = open_config(&["alice"]);
    std::fs::write(&file, config.to_string()).expect("write");
    let out = run(&["check-config", &file.display().to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains(
            "warning: namespace acme: nothing in this configuration bounds its inbox \
             (inbox.max_age_s), topics (topics.max_age_s, topics.max_bytes), tasks"
        ),
        "{text}"
    );
    config["namespaces"]["acme"]["inbox"] = json!({"max_age_s": 86400});
    config["namespaces"]["acme"]["topics"] = json!({"max_bytes": 1 << 30});
    std::fs::write(&file, config.to_string()).expect("write");
    let text = stdout(&run(&["check-config", &file.display().to_string()]));
    assert!(
        text.contains("warning: namespace acme: nothing in this configuration bounds its tasks"),
        "{text}"
    );
    assert!(!text.contains("bounds its inbox"), "{text}");
}

/// nats-server refuses a `duplicate_window` over the stream's `max_age`, so the broker
/// caps the inbox's window of the longest lease and 90 s there; check-config says what
/// that leaves unguarded, naming the jobs.
#[test]
fn check_config_warns_of_an_inbox_window_capped_at_its_max_age() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("config.json");
    let mut config = open_config(&["alice"]);
    config["namespaces"]["acme"]["inbox"] = json!({"max_age_s": 300});
    config["namespaces"]["acme"]["jobs"] = json!({"render": {"lease_s": 300}, "tiny": {}});
    std::fs::write(&file, config.to_string()).expect("write");
    let out = run(&["check-config", &file.display().to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains(
            "warning: stream AMP_INBOX_acme: duplicate_window capped at inbox.max_age_s, 300 s, \
             below the 390 s of the longest lease_s and 90 s (jobs: render)"
        ),
        "{text}"
    );
    assert!(!text.contains("AMP_DLQ_acme"), "{text}");
}

#[test]
fn check_config_describes_a_valid_file_and_names_the_member_of_a_bad_one() {
    let dir = tempfile::tempdir().expect("dir");
    let good = dir.path().join("good.json");
    let mut config = open_config(&["alice", "bob"]);
    config["limits"] = json!({"max_sessions": 500});
    config["namespaces"]["acme"]["jobs"] = json!({"resize": {"lease_s": 60}});
    std::fs::write(&good, config.to_string()).expect("write");
    let out = run(&["check-config", &good.display().to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for expected in [
        "is valid",
        "namespace acme: 2 participant(s) (0 nkey, 2 token, 0 with a policy): alice, bob",
        "job resize: lease 60 s",
        "limits (not default): max_sessions 500",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }

    // The same file through AMP_CONFIG.
    let out = amp_broker()
        .arg("check-config")
        .env("AMP_CONFIG", &good)
        .output()
        .expect("run");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("alice, bob"));

    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        json!({"namespaces": {"acme": {"participants": {"a": {}}}}}).to_string(),
    )
    .expect("write");
    let out = run(&["check-config", &bad.display().to_string()]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("namespaces.acme.participants.a") && err.contains("credential"),
        "{err}"
    );
    assert!(stdout(&out).is_empty());

    let out = run(&[
        "check-config",
        &dir.path().join("absent.json").display().to_string(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("absent.json"), "{}", stderr(&out));
}

/// A misspelt or mistyped member is named by its path, as a bad value is: before, the
/// parser's own message named only the field and a line and column, so a `permisions`
/// under one participant of many sent the operator counting columns.
#[test]
fn check_config_names_the_path_of_a_misspelt_or_mistyped_member() {
    let dir = tempfile::tempdir().expect("dir");
    let cases = [
        (
            json!({"namespaces": {"acme": {"participants": {
                "alice": {"token_sha256": "00", "permisions": {}}}}}}),
            "namespaces.acme.participants.alice.permisions: ",
            "unknown field `permisions`",
        ),
        (
            json!({"limits": {"max_frame": "big"}}),
            "limits.max_frame: ",
            "invalid type",
        ),
        (
            json!({"namespaces": {"acme": {"participants": {
                "bob": {"token_sha256": "00", "permissions": {"send": ["x", 7]}}}}}}),
            "namespaces.acme.participants.bob.permissions.send[1]: ",
            "invalid type",
        ),
    ];
    for (i, (config, path, problem)) in cases.into_iter().enumerate() {
        let file = dir.path().join(format!("bad{i}.json"));
        std::fs::write(&file, serde_json::to_string_pretty(&config).expect("json")).expect("write");
        let out = run(&["check-config", &file.display().to_string()]);
        assert_eq!(out.status.code(), Some(1));
        let err = stderr(&out);
        assert!(
            err.contains(&format!("amp-broker: configuration: {path}")) && err.contains(problem),
            "expected {path:?} and {problem:?} in: {err}"
        );
    }
}

#[test]
fn printing_to_a_closed_pipe_ends_quietly() {
    let dir = tempfile::tempdir().expect("dir");
    let good = dir.path().join("good.json");
    std::fs::write(&good, open_config(&["alice"]).to_string()).expect("write");
    let file = good.display().to_string();
    for args in [
        vec!["check-config", file.as_str()],
        vec!["--help"],
        vec!["--version"],
        vec!["keygen"],
    ] {
        // The reader is gone before the broker writes, as with `| head` once it has its lines.
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let out = amp_broker()
            .args(&args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .expect("run amp-broker");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).is_empty(), "{args:?}: {}", stderr(&out));
    }
}

/// The broker process, killed when the test ends however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn serve_takes_listen_nats_and_config_from_the_environment() {
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().expect("dir");
    let config = dir.path().join("config.json");
    std::fs::write(&config, open_config(&["alice"]).to_string()).expect("write");
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let log = std::fs::File::create(dir.path().join("broker.log")).expect("log");
    let mut broker = Running(
        amp_broker()
            .arg("serve")
            .env("AMP_LISTEN", addr.to_string())
            .env("AMP_NATS", nats.url())
            .env("AMP_CONFIG", &config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn"),
    );
    let read_log = || std::fs::read_to_string(dir.path().join("broker.log")).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Some(status)) = broker.0.try_wait() {
            panic!("amp-broker exited ({status}):\n{}", read_log());
        }
        if http_get(addr, "/healthz").is_some_and(|(status, _)| status == 200) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no /healthz on the AMP_LISTEN address:\n{}",
            read_log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Configured (not development) mode: the file from AMP_CONFIG is the one served.
    assert!(!read_log().contains("DEVELOPMENT MODE"), "{}", read_log());
}

#[test]
fn a_bad_environment_value_stops_serve_with_the_variable_named() {
    let out = amp_broker()
        .arg("serve")
        .env("AMP_REPLICAS", "9")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("AMP_REPLICAS: `9` must be 1 to 5"),
        "{}",
        stderr(&out)
    );

    // A value that is not UTF-8 is named where it is read, and does not stop `--help`.
    let not_utf8 = std::ffi::OsStr::from_bytes(b"/etc/\xff.json");
    let out = amp_broker()
        .arg("serve")
        .env("AMP_CONFIG", not_utf8)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("AMP_CONFIG: the value is not valid UTF-8"),
        "{}",
        stderr(&out)
    );
    let out = amp_broker()
        .args(["serve", "--help"])
        .env("AMP_CONFIG", not_utf8)
        .output()
        .expect("run");
    assert!(out.status.success(), "{}", stderr(&out));

    // A flag overrides its variable, which then is never read: what stops this start is the
    // loopback rule checked after every value is in.
    let out = amp_broker()
        .args(["serve", "--replicas", "1", "--listen", "0.0.0.0:1"])
        .env("AMP_REPLICAS", "9")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("loopback") && !err.contains("AMP_REPLICAS"),
        "{err}"
    );
}
