//! The command line: `amp-broker serve [flags]`, `amp-broker keygen`, `--help`, `--version`.

use std::net::SocketAddr;
use std::path::PathBuf;

pub const USAGE: &str = "\
usage: amp-broker serve [flags]     run the broker
       amp-broker keygen            print a new participant credential (NKey seed and public key)
       amp-broker --help | --version

serve flags:
  --listen ADDR          WebSocket/HTTP listen address (default 127.0.0.1:7420)
  --config FILE          configuration file (JSON); without it the broker runs in development
                         mode: namespace `dev`, any participant name, a token printed at start,
                         loopback addresses only
  --nats URL[,URL...]    use these NATS servers (repeatable) instead of starting nats-server
  --nats-creds FILE      .creds file for the broker's own NATS connection
  --nats-nkey FILE       NKey seed file (SU...) for the broker's own NATS connection
  --data-dir DIR         where the embedded nats-server keeps its store (default ./amp-data)
  --no-sync              embedded nats-server: flush JetStream writes every 2 minutes instead of
                         before each acknowledgement (faster; an OS crash can lose acknowledged
                         messages)
  --nats-server PATH     the nats-server binary to run (default: the one on PATH)
  --broker-id ID         this broker's id in challenges and registry entries (default: random)
  --replicas N           JetStream replicas for the streams the broker creates (default 1)
  --issuer-seed-file F   an NATS account seed (SA...): hello returns a scoped user JWT signed by
                         it, and the broker answers the NATS auth callout ($SYS.REQ.USER.AUTH)
  --callout-server-key K answer auth callout requests signed by this nats-server public key
                         (N..., the server's INFO server_id; repeatable, at most 64); without
                         it, the servers the broker's own NATS connection has met
";

#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Serve(Box<ServeArgs>),
    Keygen,
    Help,
    Version,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ServeArgs {
    pub listen: SocketAddr,
    pub config: Option<PathBuf>,
    pub nats: Vec<String>,
    pub nats_creds: Option<PathBuf>,
    pub nats_nkey: Option<PathBuf>,
    pub data_dir: PathBuf,
    pub sync: bool,
    pub nats_server: Option<PathBuf>,
    pub broker_id: Option<String>,
    pub replicas: u32,
    pub issuer_seed_file: Option<PathBuf>,
    pub callout_server_keys: Vec<String>,
}

impl Default for ServeArgs {
    fn default() -> Self {
        ServeArgs {
            listen: SocketAddr::from(([127, 0, 0, 1], 7420)),
            config: None,
            nats: Vec::new(),
            nats_creds: None,
            nats_nkey: None,
            data_dir: PathBuf::from("amp-data"),
            sync: true,
            nats_server: None,
            broker_id: None,
            replicas: 1,
            issuer_seed_file: None,
            callout_server_keys: Vec::new(),
        }
    }
}

/// Parses the arguments after the program name.
pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Command, String> {
    let mut args = args.into_iter();
    let command = match args.next().as_deref() {
        None | Some("-h") | Some("--help") | Some("help") => return Ok(Command::Help),
        Some("-V") | Some("--version") => return Ok(Command::Version),
        Some("keygen") => Command::Keygen,
        Some("serve") => {
            let mut serve = ServeArgs::default();
            while let Some(flag) = args.next() {
                let mut value =
                    |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
                match flag.as_str() {
                    "--listen" => {
                        let v = value("--listen")?;
                        serve.listen = v.parse().map_err(|_| {
                            format!("--listen: `{v}` is not an address like 127.0.0.1:7420")
                        })?;
                    }
                    "--config" => serve.config = Some(PathBuf::from(value("--config")?)),
                    "--nats" => {
                        let v = value("--nats")?;
                        serve.nats.extend(
                            v.split(',')
                                .map(str::trim)
                                .filter(|s| !s.is_empty())
                                .map(String::from),
                        );
                    }
                    "--nats-creds" => {
                        serve.nats_creds = Some(PathBuf::from(value("--nats-creds")?))
                    }
                    "--nats-nkey" => serve.nats_nkey = Some(PathBuf::from(value("--nats-nkey")?)),
                    "--data-dir" => serve.data_dir = PathBuf::from(value("--data-dir")?),
                    "--no-sync" => serve.sync = false,
                    "--nats-server" => {
                        serve.nats_server = Some(PathBuf::from(value("--nats-server")?))
                    }
                    "--broker-id" => {
                        let v = value("--broker-id")?;
                        if !crate::broker::config::is_name(&v) {
                            return Err(format!(
                                "--broker-id: `{v}` must be 1-64 of A-Z a-z 0-9 _ -"
                            ));
                        }
                        serve.broker_id = Some(v);
                    }
                    "--replicas" => {
                        let v = value("--replicas")?;
                        serve.replicas = match v.parse() {
                            Ok(n @ 1..=5) => n,
                            _ => return Err(format!("--replicas: `{v}` must be 1 to 5")),
                        };
                    }
                    "--issuer-seed-file" => {
                        serve.issuer_seed_file = Some(PathBuf::from(value("--issuer-seed-file")?))
                    }
                    "--callout-server-key" => {
                        let v = value("--callout-server-key")?;
                        if !crate::broker::config::is_server_key(&v) {
                            return Err(format!(
                                "--callout-server-key: `{v}` is not a server public key (N..., 56 characters)"
                            ));
                        }
                        if serve.callout_server_keys.len() >= 64 {
                            return Err("--callout-server-key: at most 64".to_string());
                        }
                        serve.callout_server_keys.push(v);
                    }
                    other => return Err(format!("serve: unknown flag `{other}`")),
                }
            }
            if serve.config.is_none() && !serve.listen.ip().is_loopback() {
                return Err(
                    "development mode (no --config) listens on loopback addresses only".to_string(),
                );
            }
            Command::Serve(Box::new(serve))
        }
        Some(other) => return Err(format!("unknown command `{other}`")),
    };
    match args.next() {
        Some(extra) => Err(format!("unexpected argument `{extra}`")),
        None => Ok(command),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(s: &str) -> Result<Command, String> {
        parse(s.split_whitespace().map(String::from))
    }

    #[test]
    fn serve_defaults_to_a_self_contained_durable_development_broker() {
        assert_eq!(parse_str("serve"), Ok(Command::Serve(Box::default())));
        assert!(ServeArgs::default().sync);
        assert!(ServeArgs::default().listen.ip().is_loopback());
    }

    #[test]
    fn serve_reads_every_flag() {
        let cmd = parse_str(
            "serve --listen 0.0.0.0:9000 --config c.json --nats nats://a:4222,nats://b:4222 --nats nats://c:4222 \
             --nats-creds x.creds --data-dir /d --no-sync --nats-server /bin/ns --broker-id b1 --replicas 3 --issuer-seed-file acct.seed",
        );
        let Ok(Command::Serve(s)) = cmd else {
            panic!("{cmd:?}")
        };
        assert_eq!(s.listen, "0.0.0.0:9000".parse().expect("addr"));
        assert_eq!(s.config, Some(PathBuf::from("c.json")));
        assert_eq!(s.nats, ["nats://a:4222", "nats://b:4222", "nats://c:4222"]);
        assert_eq!(s.nats_creds, Some(PathBuf::from("x.creds")));
        assert_eq!(s.data_dir, PathBuf::from("/d"));
        assert!(!s.sync);
        assert_eq!(s.nats_server, Some(PathBuf::from("/bin/ns")));
        assert_eq!(s.broker_id.as_deref(), Some("b1"));
        assert_eq!(s.replicas, 3);
        assert_eq!(s.issuer_seed_file, Some(PathBuf::from("acct.seed")));
    }

    #[test]
    fn callout_server_keys_repeat() {
        use crate::nkeys::{KeyKind, KeyPair};
        let keys: Vec<String> = (0..2)
            .map(|_| {
                KeyPair::generate(KeyKind::Server)
                    .expect("key")
                    .public_key()
            })
            .collect();
        let cmd = parse_str(&format!(
            "serve --callout-server-key {} --callout-server-key {}",
            keys[0], keys[1]
        ));
        let Ok(Command::Serve(s)) = cmd else {
            panic!("{cmd:?}")
        };
        assert_eq!(s.callout_server_keys, keys);
    }

    #[test]
    fn mistakes_are_named() {
        assert_eq!(
            parse_str("serve --listen"),
            Err("--listen needs a value".into())
        );
        assert!(parse_str("serve --listen nowhere").is_err_and(|e| e.contains("nowhere")));
        assert!(parse_str("serve --bogus").is_err_and(|e| e.contains("--bogus")));
        assert!(parse_str("serve --replicas 0").is_err());
        assert!(parse_str("serve --broker-id a.b").is_err());
        assert!(
            parse_str("serve --callout-server-key UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4")
                .is_err_and(|e| e.contains("--callout-server-key"))
        );
        assert!(parse_str("serve --listen 0.0.0.0:1").is_err_and(|e| e.contains("loopback")));
        assert!(parse_str("frobnicate").is_err());
        assert!(parse_str("keygen extra").is_err());
        assert_eq!(parse_str("keygen"), Ok(Command::Keygen));
        assert_eq!(parse_str(""), Ok(Command::Help));
    }
}
