//! A "gRPC server" that answers every call with a malformed
//! `grpc-status-details-bin` trailer (not base64). tonic's client panics
//! decoding it (`Status::from_header_map`); the gateway must turn that into
//! one failed call, not a crashed task or gateway.

use std::io::Write;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening on {}", listener.local_addr()?);
    std::io::stdout().flush()?;
    loop {
        let (tcp, _) = listener.accept().await?;
        tokio::spawn(async move {
            let Ok(mut conn) = h2::server::handshake(tcp).await else { return };
            while let Some(Ok((_request, mut respond))) = conn.accept().await {
                let Ok(head) =
                    http::Response::builder().status(200).header("content-type", "application/grpc").body(())
                else {
                    return;
                };
                let Ok(mut send) = respond.send_response(head, false) else { return };
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static("13"));
                trailers.insert("grpc-message", http::HeaderValue::from_static("malformed"));
                trailers.insert("grpc-status-details-bin", http::HeaderValue::from_static("!!! not base64 !!!"));
                let _ = send.send_trailers(trailers);
            }
        });
    }
}
