fn main() {
    eprintln!("amp-broker: sessions are not implemented yet; nothing is served");
    std::process::exit(2);
}
