// The images a message carries: files the user picks, pastes or drops, read as data URLs and sent as
// OpenAI `image_url` parts beside the text (the server decodes and checks them; api/images.py).

export const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];
export const MAX_IMAGE_BYTES = 20 * 1024 * 1024; // the server's limit for one image

// The image files among `files` (a FileList or an array), in order.
export function imageFilesOf(files) {
  return [...(files || [])].filter((file) => file.type.startsWith("image/"));
}

// The file as a data: URL; rejects, in a sentence, a type the server does not read or a file over its limit.
export function readImage(file) {
  if (!IMAGE_TYPES.includes(file.type)) {
    return Promise.reject(new Error(`${file.name || "the image"} is not a PNG, JPEG, WebP or GIF image`));
  }
  if (file.size > MAX_IMAGE_BYTES) {
    return Promise.reject(new Error(`${file.name || "the image"} is larger than 20 MiB, the server's limit`));
  }
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`${file.name || "the image"} could not be read`));
    reader.readAsDataURL(file);
  });
}

// A user message's content: the text alone, or the images (as image_url parts) and then the text.
export function contentOf(text, images) {
  if (!images.length) return text;
  const parts = images.map((url) => ({type: "image_url", image_url: {url}}));
  return text ? [...parts, {type: "text", text}] : parts;
}

// The data URLs of a message's image parts.
export function imagesOf(content) {
  return typeof content === "string" ? [] : content.filter((p) => p.type === "image_url").map((p) => p.image_url.url);
}

// A thumbnail of one image, titled with its place in the message.
export function thumbnail(url, index) {
  const image = document.createElement("img");
  image.className = "thumb";
  image.src = url;
  image.alt = `image ${index + 1}`;
  return image;
}
