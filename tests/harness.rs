mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;

#[test]
fn nats_server_starts_with_jetstream_and_restarts_on_the_same_port() {
    let mut server = common::NatsServer::start();
    let info = |addr: &str| {
        let stream = TcpStream::connect(addr).expect("connect");
        let mut line = String::new();
        BufReader::new(stream)
            .read_line(&mut line)
            .expect("INFO line");
        line
    };
    let first = info(&server.addr());
    assert!(first.starts_with("INFO {"), "{first}");
    assert!(first.contains("\"jetstream\":true"), "{first}");
    let port = server.port;
    server.restart();
    assert_eq!(server.port, port);
    let mut stream = TcpStream::connect(server.addr()).expect("connect after restart");
    stream
        .write_all(b"CONNECT {\"verbose\":false}\r\nPING\r\n")
        .expect("write");
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).expect("INFO");
    line.clear();
    reader.read_line(&mut line).expect("PONG");
    assert_eq!(line, "PONG\r\n");
}
