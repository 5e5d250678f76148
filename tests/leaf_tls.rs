//! The leaf link over TLS: a hub whose leafnodes listener requires TLS and verifies leaf
//! certificates (`verify: true`), certificates made at test time, and site brokers whose
//! embedded nats-server dials it with `--leaf-tls-ca/-cert/-key`. Namespace `fleet` lives
//! in the hub's domain, `local` at the site.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::NatsServer;
use common::amp::{Broker, Client, token_hash};
use common::tls::Pki;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(15);

fn participants(names: &[&str]) -> Value {
    let all = json!([">"]);
    names
        .iter()
        .map(|n| {
            let p = json!({
                "token_sha256": token_hash(&format!("{n}-token")),
                "permissions": {"send": all, "publish": all, "subscribe": all},
            });
            (n.to_string(), p)
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn fleet() -> Value {
    json!({"jetstream_domain": "hub", "participants": participants(&["alice", "bob"])})
}

fn site_config() -> Value {
    json!({"namespaces": {
        "fleet": fleet(),
        "local": {"participants": participants(&["carol", "dave"])},
    }})
}

/// A hub (domain `hub`) whose leaf nodes must speak TLS and show a certificate of the
/// test CA; its broker serves `fleet`.
fn tls_hub(pki: &Pki) -> (NatsServer, u16, Broker) {
    let leaf_port = common::free_port();
    let hub = NatsServer::with_jetstream(
        "  domain: hub",
        &format!(
            "server_name: hub\nleafnodes {{\n  listen: 127.0.0.1:{leaf_port}\n  no_advertise: true\n  tls {{\n    \
             cert_file: \"{}\"\n    key_file: \"{}\"\n    ca_file: \"{}\"\n    verify: true\n  }}\n}}\n",
            pki.server.cert.display(),
            pki.server.key.display(),
            pki.ca.display()
        ),
    );
    let broker = Broker::start_with(
        &hub.url(),
        &json!({"namespaces": {"fleet": fleet()}}),
        &["--broker-id", "hub"],
    );
    (hub, leaf_port, broker)
}

fn site(id: &str, url: &str, tls_flags: &[String]) -> Broker {
    let mut args = vec!["--broker-id", id, "--leaf-remote", url];
    args.extend(tls_flags.iter().map(String::as_str));
    Broker::start_embedded(&site_config(), &args)
}

/// CA, client certificate and key flags.
fn tls_flags(ca: &std::path::Path, pki: &Pki) -> Vec<String> {
    vec![
        "--leaf-tls-ca".to_string(),
        ca.display().to_string(),
        "--leaf-tls-cert".to_string(),
        pki.client.cert_arg(),
        "--leaf-tls-key".to_string(),
        pki.client.key_arg(),
    ]
}

fn login(broker: &Broker, ns: &str, name: &str) -> Client {
    Client::login(broker, ns, name, &format!("{name}-token"))
}

/// Sends until `ok`: the leaf link needs a moment after start. The same `idem` every
/// time, so the message is stored once.
fn send_until_ok(c: &mut Client, to: &str, body: Value, idem: &str) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let r = c.request(json!({"op":"send","to":to,"body":body,"idem":idem}));
        if r["op"] == "ok" || Instant::now() >= deadline {
            return r;
        }
        assert_eq!(r["code"], "unavailable", "{r}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn site_nats_log(site: &Broker) -> String {
    std::fs::read_to_string(site.dir().join("data").join("nats-server.log")).unwrap_or_default()
}

#[test]
fn sites_with_the_hub_ca_and_a_client_certificate_link_over_tls_with_either_url_scheme() {
    let pki = Pki::new();
    let (_hub, leaf_port, hub_broker) = tls_hub(&pki);
    let mut alice = login(&hub_broker, "fleet", "alice");
    // tls:// asks for TLS; with nats-leaf:// the TLS files alone do, as a tls block does
    // in nats-server. The hub accepts nothing but TLS with a verified certificate.
    for (id, url) in [
        ("site1", format!("tls://127.0.0.1:{leaf_port}")),
        ("site2", format!("nats-leaf://127.0.0.1:{leaf_port}")),
    ] {
        let site = site(id, &url, &tls_flags(&pki.ca, &pki));
        let mut bob = login(&site, "fleet", "bob");
        let r = send_until_ok(&mut bob, "alice", json!(id), id);
        assert_eq!(
            r["op"],
            "ok",
            "{r}\nsite nats-server log:\n{}",
            site_nats_log(&site)
        );
        let m = alice.next_op("message", WAIT).expect("message at the hub");
        assert_eq!(m["body"], id, "{m}");
        assert_eq!(m["from"], "fleet/bob", "{m}");
        alice.send(&json!({"op":"ack","seq":m["seq"]}));
        let mut carol = login(&site, "local", "carol");
        let r = carol.request(json!({"op":"send","to":"dave","body":1}));
        assert_eq!(r["op"], "ok", "{r}");
    }
}

/// Against the untrusted CA, with no CA at all (tls:// alone: the system's CAs, which know
/// nothing of the test CA, so TLS is on rather than a plain link) and without a client
/// certificate.
#[test]
fn sites_that_distrust_the_hub_or_show_no_certificate_do_not_link_and_serve_local_namespaces() {
    let pki = Pki::new();
    let (hub, leaf_port, _hub_broker) = tls_hub(&pki);
    let url = format!("tls://127.0.0.1:{leaf_port}");
    let ca_only = vec!["--leaf-tls-ca".to_string(), pki.ca.display().to_string()];
    let unknown_ca = "certificate signed by unknown authority";
    // (site, its flags, the refusal, whether the hub logs it rather than the site). The hub
    // logs a missing client certificate only as a leaf connection that closed at once.
    for (id, flags, refusal, at_hub) in [
        (
            "site1",
            tls_flags(&pki.untrusted_ca, &pki),
            unknown_ca,
            false,
        ),
        ("site2", Vec::new(), unknown_ca, false),
        ("site3", ca_only, "Leafnode connection closed", true),
    ] {
        let earlier = if at_hub {
            hub.log().matches(refusal).count()
        } else {
            0
        };
        let site = site(id, &url, &flags);
        let log = |site: &Broker| {
            if at_hub {
                hub.log()
            } else {
                site_nats_log(site)
            }
        };
        assert!(
            common::wait_until(WAIT, || log(&site).matches(refusal).count() > earlier),
            "{id}: site nats-server log:\n{}\nhub log:\n{}",
            site_nats_log(&site),
            hub.log()
        );
        let mut bob = login(&site, "fleet", "bob");
        let r = bob.request(json!({"op":"send","to":"alice","body":"x"}));
        assert_eq!(r["code"], "unavailable", "{id}: {r}");
        let mut carol = login(&site, "local", "carol");
        let r = carol.request(json!({"op":"send","to":"dave","body":1}));
        assert_eq!(r["op"], "ok", "{id}: {r}");
    }
}

#[test]
fn a_missing_leaf_tls_file_stops_the_start_with_the_flag_named() {
    let dir = tempfile::tempdir().expect("dir");
    let missing = dir.path().join("hub-ca.pem");
    let out = Command::new(env!("CARGO_BIN_EXE_amp-broker"))
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{}", common::free_port()),
        ])
        .args(["--leaf-remote", "tls://127.0.0.1:7422", "--leaf-tls-ca"])
        .arg(&missing)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--nats-server")
        .arg(common::nats_server_bin())
        .output()
        .expect("run amp-broker");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--leaf-tls-ca") && err.contains("hub-ca.pem"),
        "{err}"
    );
    assert!(
        !dir.path().join("data").join("nats-server.conf").exists(),
        "nats-server was configured before the files were checked"
    );
}
