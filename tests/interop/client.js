// Calls visor.v1.Gateway/Generate using only gateway.proto, and prints one JSON line:
// {"deltas": [...], "final": {...}} or {"error": {"code": N, "details": "..."}}.
// Usage: node client.js HOST:PORT IMAGE PROMPT [KEY]
"use strict";
const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const [target, image, prompt, key = "visor-dev-key"] = process.argv.slice(2);
const protoDir = path.resolve(__dirname, "..", "..", "protos");
const def = loader.loadSync(path.join(protoDir, "visor/v1/gateway.proto"), {
  includeDirs: [protoDir], keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
});
const visor = grpc.loadPackageDefinition(def).visor.v1;
const client = new visor.Gateway(target, grpc.credentials.createInsecure());
const metadata = new grpc.Metadata();
metadata.add("authorization", `Bearer ${key}`);
const request = {
  prompt,
  media: [{ data: fs.readFileSync(image) }],
  params: { max_new_tokens: 6 },
  detail: "DETAIL_AUTO",
};
const deltas = [];
let final = null;
const call = client.Generate(request, metadata, { deadline: Date.now() + 60000 });
call.on("data", (event) => {
  if (event.kind === "delta") deltas.push(event.delta.text);
  else final = event.final;
});
call.on("error", (err) => {
  console.log(JSON.stringify({ error: { code: err.code, details: err.details } }));
  process.exit(0);
});
call.on("end", () => {
  console.log(JSON.stringify({ deltas, final }));
  process.exit(0);
});
