mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::time::Duration;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;

use amp_broker::embedded::{EmbeddedOptions, EmbeddedServer};
use amp_broker::nats;

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
        ready_timeout: Duration::from_secs(20),
        ..EmbeddedOptions::new(common::nats_server_bin(), dir.path().to_path_buf())
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
        ready_timeout: Duration::from_secs(5),
        ..EmbeddedOptions::new(
            dir.path().join("no-such-nats-server"),
            dir.path().to_path_buf(),
        )
    })
    .err()
    .expect("start fails");
    assert!(err.to_string().contains("no-such-nats-server"), "{err}");
}

/// What a local process gets after CONNECT `connect` and PING: the first line after INFO.
fn answer_to_connect(url: &str, connect: &str) -> String {
    let addr = url.trim_start_matches("nats://");
    let mut stream = TcpStream::connect(addr).expect("connect to the embedded server");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut info = String::new();
    reader.read_line(&mut info).expect("INFO");
    assert!(info.starts_with("INFO "), "{info}");
    stream
        .write_all(format!("CONNECT {connect}\r\nPING\r\n").as_bytes())
        .expect("write");
    let mut line = String::new();
    reader.read_line(&mut line).expect("answer");
    line
}

#[test]
fn embedded_server_refuses_local_clients_without_the_generated_credential() {
    let dir = tempfile::tempdir().expect("data dir");
    let server = EmbeddedServer::start(EmbeddedOptions {
        ready_timeout: Duration::from_secs(20),
        ..EmbeddedOptions::new(common::nats_server_bin(), dir.path().to_path_buf())
    })
    .expect("embedded nats-server starts");

    for connect in [
        r#"{"verbose":false}"#,
        r#"{"verbose":false,"user":"broker","pass":"broker"}"#,
        r#"{"verbose":false,"auth_token":"anything"}"#,
    ] {
        let answer = answer_to_connect(&server.url(), connect);
        assert!(
            answer.starts_with("-ERR 'Authorization Violation'"),
            "{connect}: {answer}"
        );
    }
    // Another NKey cannot sign for the broker's.
    let other =
        amp_broker::nkeys::KeyPair::generate(amp_broker::nkeys::KeyKind::User).expect("key");
    let stranger = nats::Options::parse_servers(&server.url())
        .expect("url")
        .with_nkey_seed(&other.seed())
        .expect("seed");
    assert!(nats::Client::connect(stranger).is_err());

    let file = server.credential_path();
    let mode = std::fs::metadata(&file)
        .expect("credential file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "{}", file.display());
    let conf = dir.path().join("nats-server.conf");
    let mode = std::fs::metadata(&conf)
        .expect("config")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let seed = std::fs::read_to_string(&file).expect("read seed");
    assert_eq!(seed.trim(), server.nkey_seed());

    let broker = nats::Options::parse_servers(&server.url())
        .expect("url")
        .with_nkey_seed(seed.trim())
        .expect("seed");
    let mut client = nats::Client::connect(broker).expect("the broker's credential is accepted");
    let reply = client
        .request("$JS.API.INFO", None, b"", Duration::from_secs(5))
        .expect("JetStream answers the broker");
    assert!(
        String::from_utf8_lossy(&reply.payload).contains("account_info_response"),
        "{:?}",
        String::from_utf8_lossy(&reply.payload)
    );
}

/// The embedded server's URL, from the broker's start-up line.
fn embedded_url(log: &str) -> String {
    let rest = log
        .split("embedded nats-server at ")
        .nth(1)
        .expect("start-up line");
    rest.split_whitespace().next().expect("url").to_string()
}

#[test]
fn behind_the_lock_participants_still_get_in_through_the_auth_callout() {
    let dir = tempfile::tempdir().expect("dir");
    let seed = dir.path().join("issuer.seed");
    let issuer =
        amp_broker::nkeys::KeyPair::generate(amp_broker::nkeys::KeyKind::Account).expect("key");
    std::fs::write(&seed, issuer.seed()).expect("write seed");
    let broker = common::amp::Broker::start_embedded(
        &common::amp::open_config(&["bob"]),
        &["--issuer-seed-file", &seed.display().to_string()],
    );
    let url = embedded_url(&broker.log());
    let conf = std::fs::read_to_string(broker.dir().join("data").join("nats-server.conf"))
        .expect("embedded config");
    assert!(conf.contains(&issuer.public_key()), "{conf}");

    let participant = |pass: &str| {
        nats::Options::parse_servers(&url)
            .expect("url")
            .with_user_password("acme/bob", pass)
            .with_inbox_prefix("_INBOX_acme_bob")
    };
    assert!(
        nats::Client::connect(participant("wrong")).is_err(),
        "a wrong token is refused by the callout"
    );
    let mut bob = nats::Client::connect(participant("bob-token"))
        .expect("the callout admits bob with his token");
    // Scoped: bob's own inbox consumer is his to read, JetStream's account info is not.
    let refused = bob.request("$JS.API.INFO", None, b"", Duration::from_secs(2));
    assert!(refused.is_err(), "{refused:?}");
}

/// The nats-server a broker started, found by its parent PID.
fn children_of(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
        // Fields after the command name in parentheses: state, then the parent's PID.
        let after = stat.rsplit_once(") ").map_or("", |(_, rest)| rest);
        if after.split_whitespace().nth(1) == Some(&pid.to_string()) {
            found.push(child);
        }
    }
    found
}

#[test]
fn a_broker_killed_outright_takes_its_embedded_server_with_it() {
    let mut broker = common::amp::Broker::start_embedded(&common::amp::open_config(&["bob"]), &[]);
    let pid = broker.pid().expect("broker running");
    let children = children_of(pid);
    assert_eq!(children.len(), 1, "one embedded nats-server: {children:?}");
    let server = children[0];
    assert!(pid_alive(server));
    // SIGKILL: the broker gets no chance to stop its child itself.
    broker.kill();
    assert!(
        common::wait_until(Duration::from_secs(20), || !pid_alive(server)),
        "the embedded nats-server {server} outlived its broker"
    );
}
