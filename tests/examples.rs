//! The deployment examples in `examples/` run as written: their nats-server files and
//! broker scripts, with fixed ports and directories rewritten to free ones.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::amp::{Broker, Client};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(15);

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

/// One example's rewriting: fixed ports to free ones, `/var/lib/...` and `$DATA` to a
/// temporary directory.
struct Rewrite {
    ports: BTreeMap<u16, u16>,
    dir: tempfile::TempDir,
}

impl Rewrite {
    fn new(ports: &[u16]) -> Rewrite {
        Rewrite {
            ports: ports.iter().map(|p| (*p, common::free_port())).collect(),
            dir: tempfile::tempdir().expect("example dir"),
        }
    }

    fn port(&self, fixed: u16) -> u16 {
        self.ports[&fixed]
    }

    fn apply(&self, text: &str, example: &Path) -> String {
        let tmp = self.dir.path().display().to_string();
        let mut text = text
            .replace("\"$(dirname \"$0\")/", &format!("{}/", example.display()))
            .replace("\"$DATA\"", &format!("{tmp}/data"))
            .replace("\"/var/lib/", &format!("\"{tmp}/"));
        for (fixed, free) in &self.ports {
            text = text.replace(&format!(":{fixed}"), &format!(":{free}"));
        }
        text
    }

    /// The `amp-broker` arguments of a run script.
    fn broker_args(&self, script: &Path) -> Vec<String> {
        let text = std::fs::read_to_string(script).expect("script");
        let example = script.parent().expect("example dir");
        let text = self.apply(&text, example);
        let command = text
            .split("exec amp-broker")
            .nth(1)
            .expect("exec amp-broker line");
        command
            .replace("\\\n", " ")
            .split_whitespace()
            .map(|t| t.trim_matches('"').to_string())
            .collect()
    }

    fn broker(&self, script: &Path) -> Broker {
        let mut args = self.broker_args(script);
        if !args.iter().any(|a| a == "--nats") {
            args.push("--nats-server".to_string());
            args.push(common::nats_server_bin().display().to_string());
        }
        let listen = args
            .iter()
            .position(|a| a == "--listen")
            .and_then(|i| args.get(i + 1))
            .expect("--listen")
            .parse()
            .expect("listen address");
        Broker::start_raw(args, listen)
    }

    fn nats_server(&self, conf: &Path) -> NatsProcess {
        let text = self.apply(&std::fs::read_to_string(conf).expect("conf"), conf);
        let path = self.dir.path().join(conf.file_name().expect("name"));
        std::fs::write(&path, text).expect("write conf");
        let log = std::fs::File::create(path.with_extension("log")).expect("log");
        let child = Command::new(common::nats_server_bin())
            .arg("-c")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn nats-server");
        NatsProcess(child)
    }
}

/// A nats-server started from an example's file, killed (by PID) when dropped.
struct NatsProcess(Child);

impl Drop for NatsProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn login(broker: &Broker, ns: &str, name: &str) -> Client {
    Client::login(broker, ns, name, &format!("{name}-token"))
}

/// `from` sends to `to` (retrying while the path is still coming up) and `to` gets it.
fn exchange(from: &mut Client, to: &mut Client, to_name: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let r = from.request(json!({"op":"send","to":to_name,"body":"hello","idem":"x1"}));
        if r["op"] == "ok" {
            break;
        }
        assert!(Instant::now() < deadline, "{r}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let m = to.next_op("message", WAIT).expect("message");
    assert_eq!(m["body"], "hello", "{m}");
    to.send(&json!({"op":"ack","seq":m["seq"]}));
}

#[test]
fn every_example_configuration_is_valid() {
    let mut seen = 0;
    for dir in std::fs::read_dir(examples()).expect("examples") {
        let dir = dir.expect("entry").path();
        if !dir.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&dir).expect("example") {
            let file = file.expect("entry").path();
            match file.extension().and_then(|e| e.to_str()) {
                Some("json") => {
                    amp_broker::broker::config::Config::load(&file)
                        .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                }
                Some("conf") => {
                    let out = Command::new(common::nats_server_bin())
                        .arg("-t")
                        .arg("-c")
                        .arg(&file)
                        .output()
                        .expect("nats-server -t");
                    assert!(out.status.success(), "{}: {out:?}", file.display());
                }
                Some("sh") => {
                    let mode = std::fs::metadata(&file)
                        .expect("script")
                        .permissions()
                        .mode();
                    assert!(mode & 0o111 != 0, "{} is not executable", file.display());
                }
                _ => continue,
            }
            seen += 1;
        }
    }
    assert!(seen >= 13, "only {seen} example files");
}

#[test]
fn the_edge_node_example_runs_locked_down() {
    let r = Rewrite::new(&[7420]);
    let broker = r.broker(&examples().join("edge-node/run.sh"));
    let mut sensor = login(&broker, "site", "sensor");
    let mut controller = login(&broker, "site", "controller");
    exchange(&mut sensor, &mut controller, "controller");
    let seed = r.dir.path().join("data").join("broker.nk");
    let mode = std::fs::metadata(&seed)
        .expect("credential")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let conf = std::fs::read_to_string(r.dir.path().join("data").join("nats-server.conf"))
        .expect("embedded config");
    assert!(conf.contains("max_file_store: 1073741824"), "{conf}");
}

#[test]
fn the_leaf_site_example_reaches_the_hub() {
    let r = Rewrite::new(&[4222, 7422, 7430, 7420]);
    let _hub = r.nats_server(&examples().join("leaf-site/hub-nats.conf"));
    assert!(common::wait_until(WAIT, || std::net::TcpStream::connect((
        "127.0.0.1",
        r.port(4222)
    ))
    .is_ok()));
    let hub_broker = r.broker(&examples().join("leaf-site/run-hub.sh"));
    let site = r.broker(&examples().join("leaf-site/run-site.sh"));
    let mut alice = login(&hub_broker, "fleet", "alice");
    let mut bob = login(&site, "fleet", "bob");
    exchange(&mut bob, &mut alice, "alice");
    let mut carol = login(&site, "local", "carol");
    let mut dave = login(&site, "local", "dave");
    exchange(&mut carol, &mut dave, "dave");
}

#[test]
fn the_cluster_example_serves_from_two_brokers() {
    let r = Rewrite::new(&[4222, 4223, 4224, 6222, 6223, 6224, 7420, 7421]);
    let _nodes: Vec<NatsProcess> = (0..3)
        .map(|i| r.nats_server(&examples().join(format!("cluster/node{i}.conf"))))
        .collect();
    // The brokers create R3 streams at start: wait until all three peers are in.
    let urls = format!(
        "nats://127.0.0.1:{},nats://127.0.0.1:{}",
        r.port(4222),
        r.port(4223)
    );
    assert!(common::wait_until(Duration::from_secs(30), || {
        let Ok(mut c) = amp_broker::nats::Options::parse_servers(&urls)
            .map_err(|e| e.to_string())
            .and_then(|o| amp_broker::nats::Client::connect(o).map_err(|e| e.to_string()))
        else {
            return false;
        };
        let probe = json!({"name": "PROBE", "subjects": ["probe"], "num_replicas": 3});
        let created = c
            .request(
                "$JS.API.STREAM.CREATE.PROBE",
                None,
                probe.to_string().as_bytes(),
                Duration::from_secs(5),
            )
            .ok()
            .and_then(|m| serde_json::from_slice::<Value>(&m.payload).ok())
            .is_some_and(|v| v["error"].is_null());
        created
            && c.request(
                "$JS.API.STREAM.DELETE.PROBE",
                None,
                b"",
                Duration::from_secs(5),
            )
            .is_ok()
    }));
    let a = r.broker(&examples().join("cluster/run-broker-a.sh"));
    let b = r.broker(&examples().join("cluster/run-broker-b.sh"));
    let mut alice = login(&a, "acme", "alice");
    let mut bob = login(&b, "acme", "bob");
    exchange(&mut alice, &mut bob, "bob");
}
